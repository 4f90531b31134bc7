"""google/jaxloop's constants."""

DEFAULT_SIGNATURE_KEY = "serving_default"
"""The signature name a SavedModel export serves by default (TensorFlow's default key)."""
