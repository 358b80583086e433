"""Megatron-style tensor parallelism: the group and its deterministic collectives (comm.py), the sharding of the
one weight copy (shard.py), and the processes of a sharded LLM (launch.py, imported where used: it needs the engine).
"""
from selfspec.parallel.comm import SOLO, TensorParallel
from selfspec.parallel.shard import check_tensor_parallel, shard_state_dict

__all__ = ["SOLO", "TensorParallel", "check_tensor_parallel", "shard_state_dict"]
