"""The contract between slipstream's layers: what the operator, the gateway, the engine's config
and the simulator must agree on, written once. Depends on pydantic alone and imports nothing else
of slipstream."""
