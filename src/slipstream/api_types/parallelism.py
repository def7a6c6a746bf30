"""``spec.parallelism``: how one replica of the model is split over GPUs and pods (KServe
LLMInferenceService's names), and the names ``slipstream serve`` and the operator share for it.

One replica is ``pipeline`` pods (pipeline stages, one per node) of ``tensor`` ranks each; a
pod's server starts its own local worker process per rank. With ``pipeline`` > 1 the operator
runs the replica as one group of a LeaderWorkerSet (kubernetes-sigs/lws): node rank 0, the
leader, runs the scheduler and the HTTP API; the other ranks run workers and serve ``/health``.

Memory arithmetic (bf16, 2 bytes per parameter): Llama-3-8B's weights are 16 GB (one 80 GB
GPU); Llama-3-70B's are 140 GB, plus the KV cache: tensor 8 on one 8-GPU node, or pipeline 2 ×
tensor 4 over two 4-GPU nodes.
"""
from __future__ import annotations

from .schema import CelRule, SpecModel, spec_field

# The serve flags (vLLM's names; multi-node as vLLM's multiprocessing backend takes them).
TENSOR_PARALLEL_FLAG = "--tensor-parallel-size"
PIPELINE_PARALLEL_FLAG = "--pipeline-parallel-size"
NNODES_FLAG = "--nnodes"
NODE_RANK_FLAG = "--node-rank"
MASTER_ADDR_FLAG = "--master-addr"
MASTER_PORT_FLAG = "--master-port"
# The leader's rendezvous port (torch.distributed's customary one); the workers dial it.
MASTER_PORT = 29500

# LeaderWorkerSet (kubernetes-sigs/lws, api/leaderworkerset/v1): one group per replica.
LWS_GROUP = "leaderworkerset.x-k8s.io"
LWS_VERSION = "v1"
LWS_KIND = "LeaderWorkerSet"
LWS_PLURAL = "leaderworkersets"
# What LWS's pod webhook puts into every container of a group's pods (pkg/utils/pod AddLWSVariables):
# the leader pod's DNS name, the group's size in pods, and this pod's index in it (0: leader).
LWS_LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"
LWS_GROUP_SIZE_ENV = "LWS_GROUP_SIZE"
LWS_WORKER_INDEX_ENV = "LWS_WORKER_INDEX"
# The label LWS puts on each pod with its index in the group; the leader's is "0".
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LEADER_WORKER_INDEX = "0"

GPUS_EQUAL_TENSOR_MESSAGE = (
    "spec.resources.gpus must equal spec.parallelism.tensor: each tensor-parallel rank of a pod "
    "drives one GPU; set gpus alone (tensor follows it) or both to the same number")
# On the spec's node: the rule reads two siblings. has(): parallelism.tensor has no CRD default,
# so that gpus: N alone can mean tensor N.
GPUS_EQUAL_TENSOR_RULE = CelRule(
    "!has(self.parallelism) || !has(self.parallelism.tensor) || !has(self.resources) || "
    "!has(self.resources.gpus) || self.resources.gpus == 0 || "
    "self.resources.gpus == self.parallelism.tensor",
    GPUS_EQUAL_TENSOR_MESSAGE)


class ParallelismSpec(SpecModel):
    """``spec.parallelism``: ``tensor`` ranks per pod (None: ``spec.resources.gpus``, or 1 on
    CPU; see :meth:`InferenceServiceSpec.tensor_parallel_size
    <slipstream.api_types.inference_service.InferenceServiceSpec.tensor_parallel_size>`) and
    ``pipeline`` pods per replica."""

    tensor: int | None = spec_field(
        None, ge=1, crd_default=False,
        description="Tensor-parallel ranks per pod, each on one GPU (spec.resources.gpus, which "
                    "then must be equal or unset) or, on CPU pods, a process sharing the pod's "
                    "cores. Unset: spec.resources.gpus, or 1 on CPU.")
    pipeline: int = spec_field(
        1, ge=1,
        description="Pipeline stages, one pod (node) each, per replica. Above 1 a replica is a "
                    "group of a LeaderWorkerSet (the LWS controller must be installed): the "
                    "leader pod serves the API, the others run the later stages.")
