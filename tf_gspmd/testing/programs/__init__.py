"""The op sweep's programs, one module per op family; each registers its kinds
(`op_builders.program`)."""
