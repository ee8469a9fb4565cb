"""CUDA-graph capture of the decode step (buckets, static input buffers, the graph runner).

The runner itself lands with the graph-runner issue; the engine runs decode eagerly until then.
"""
