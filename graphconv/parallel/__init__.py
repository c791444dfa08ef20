"""Tensor parallelism: the sharding plan of a network (sharding.py) and the compile of its ranks
(tensor_parallel.py)."""
