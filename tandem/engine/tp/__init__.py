"""Tensor parallelism over torch.distributed (Gloo on CPU, NCCL on CUDA, the same calls).

Megatron-style: the qkv and gate/up projections are split by output (heads, intermediate
channels), o and down by input, each followed by one all-reduce; the embedding and the LM head are
split by vocabulary (the embedding all-reduces, the logits are gathered on rank 0). KV heads are
split across ranks, or replicated when there are more ranks than KV heads, so each rank's paged
KV cache holds its heads under the same block table.

One engine is `tensor_parallel_size` ranks: rank 0 (the engine's own process) schedules and
broadcasts each step's inputs (`step.StepMessage`); ranks 1.. are processes its launcher starts
(`ranks.Ranks`: local processes, or Ray actors from tandem/cluster/) that run the model on what
they receive.

- `group.py`   the process group and its collectives (`TPGroup`)
- `shard.py`   which part of each weight a rank keeps, and the checks of a configuration
- `step.py`    the step message rank 0 broadcasts
- `ranks.py`   the ranks and their launchers, and the runner that broadcasts (rank 0) or serves
               (the others)
- `kv_view.py` the heads each rank holds, and a window of a rank's heads (a per-rank KV
               transfer's stream)
- `mailbox.py` orders and reports between rank 0 and a worker's service in the other ranks
"""
