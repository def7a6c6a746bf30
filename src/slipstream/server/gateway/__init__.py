"""``slipstream gateway``: an OpenAI-compatible proxy in front of a service's pods that routes each
request by prefix-cache and load (:mod:`.routing`) and holds requests while no pod can take them.
Speaks HTTP to the pods only; imports no engine code."""
