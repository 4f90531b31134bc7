"""What plugs into the loops: the `Action` base and the `ActionContext` actions are given,
`triggers` (when an action fires) and `step_actions` (when a Step's own actions fire)."""
