"""The graph layer: TF functions in, IR out, and back (capture, IR, rebuild, static values).

It knows TensorFlow graphs and reads sharding annotations as values, but makes no layout
decision: propagation and the partitioner sit above it.
"""
