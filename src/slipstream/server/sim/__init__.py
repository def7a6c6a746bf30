"""Simulation: a cost model of LLM steps on named GPUs, the ``--model sim:PROFILE`` backend for
``slipstream serve``, and the virtual-time replicas behind ``slipstream simulate``.

``cost_model`` (pure: step time from a batch's shape) · ``backend`` (the real engine with the
cost model in place of the forward pass, sleeping the modelled time) · ``trace`` (arrival
schedules) · ``cluster`` (replicas on a virtual clock, the autoscaling policy in the loop) ·
``head_of_line`` (static vs continuous batching, the textbook example).
"""
