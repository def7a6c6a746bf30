"""slipstream: Kubernetes-native LLM serving.

``slipstream.server`` (engine, OpenAI API, gateway, models, weights, simulator),
``slipstream.operator`` (the kopf operator), ``slipstream.kernels`` (Triton and CPU kernels) and
``slipstream.api_types`` (the contract the operator and the server share).
"""
