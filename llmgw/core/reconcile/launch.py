"""Launch: what one node needs to start one shard of a replica."""

from __future__ import annotations

from llmgw.core import events
from llmgw.core.profile import LaunchSpec, ModelProfile
from llmgw.core.state import ClusterState


def launch_spec(
    state: ClusterState,
    profile: ModelProfile,
    sa: events.ShardAssignment,
    layout: tuple[events.ShardAssignment, ...],
    *,
    fabric: str,
    gpu_class: str,
) -> LaunchSpec:
    """Everything one node needs to start shard `sa` of a replica laid out as `layout`. Pure.

    For a multi-node replica, NCCL_IB_HCA lists exactly this node's HCAs on the
    chosen fabric in NCCL's exact-match syntax (`=mlx5_0,mlx5_1`): an open list
    lets NCCL pick an adapter whose peer is unreachable, and the job hangs on
    its first all-reduce instead of failing.
    """
    head = layout[0]
    env = dict(profile.env)
    nnodes = len(layout)
    if nnodes > 1:
        node = state.nodes[sa.node]
        hcas = next((f.hcas for f in node.fabrics if f.name == fabric), ())
        env["NCCL_IB_HCA"] = "=" + ",".join(hcas)
    return LaunchSpec(
        engine=profile.engine,
        model=profile.engine_model,
        served_name=profile.name,
        aliases=profile.aliases,
        port=sa.port,
        gpus=tuple(sa.gpus),
        gpu_class=gpu_class,
        tensor_parallel=profile.tensor_parallel,
        pipeline_parallel=profile.pipeline_parallel,
        nnodes=nnodes,
        node_rank=sa.shard,
        head_address=state.nodes[head.node].address if nnodes > 1 else "",
        head_port=head.port + 1 if nnodes > 1 else 0,
        fabric=fabric if nnodes > 1 else "",
        dtype=profile.dtype,
        max_model_len=profile.max_model_len,
        engine_args=profile.engine_args,
        env=env,
        start_timeout_s=profile.start_timeout_s,
        load_timeout_s=profile.load_timeout_s,
    )
