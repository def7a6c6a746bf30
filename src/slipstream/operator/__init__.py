"""The InferenceService operator (kopf): ``slipstream operator``.

Modules, from pure to side-effecting: ``spec`` (typed, defaulted, validated spec), ``resources``
(spec → Deployment and Service), ``status`` (conditions), ``drift`` (live vs rendered),
``kube`` (a small REST client), ``reconcile`` (one idempotent reconcile), ``scaling`` (where the
autoscaler writes replicas and metrics), ``handlers`` (kopf triggers), ``cli``.
See README.md beside this file.
"""
