"""A partitioned program kept or handed on: checkpoints, SavedModel and XLA exports, serving.

* `checkpoint`: `save_checkpoint` / `restore_checkpoint` of sharded variables, each saved
  whole under its own name, restorable on another mesh;
* `saved_model`: `save` / `load` (a SavedModel plain TF serves), `save_xla` / `load_xla`
  (the per-replica StableHLO module with its layouts and values);
* `serve`: `python -m tf_gspmd.export.serve --export DIR`, a device server with the
  export's devices, for `saved_model_cli run --worker`.
"""
