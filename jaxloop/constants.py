"""google/jaxloop's constants.

Example::

    from jaxloop import constants
    signatures = {constants.DEFAULT_SIGNATURE_KEY: serving_fn}
"""

DEFAULT_SIGNATURE_KEY = "serving_default"
"""The signature name a SavedModel export serves by default (TensorFlow's default key)."""
