"""Keras 3 model.fit / evaluate running partitioned, against the same model run plainly."""

import numpy as np
from keras_workflows import workflow_model as _model

import tf_gspmd as tg
from tf_gspmd.testing import as_float32, assert_close


def test_fit_and_evaluate_match_unpartitioned():
  mesh = tg.Mesh.create((2, 4), ('data', 'model'))
  model, reference = _model(), _model()
  layout = tg.LayoutMap(mesh)
  layout[r'.*h0/kernel'] = tg.P(None, 'model')
  layout[r'.*h0/bias'] = tg.P('model')
  layout[r'.*out/kernel'] = tg.P('model', None)
  assert len(layout.apply(model)) == 3
  tg.partition_model(model, mesh)
  rng = np.random.RandomState(0)
  x, y = rng.randn(64, 16).astype(np.float32), rng.randint(0, 4, 64).astype(np.int32)
  kw = dict(batch_size=16, epochs=2, shuffle=False, verbose=0, validation_data=(x[:32], y[:32]))
  got, want = model.fit(x, y, **kw).history, reference.fit(x, y, **kw).history
  assert len(want['loss']) == 2 and 'val_accuracy' in want
  # losses, accuracy and validation metrics, epoch by epoch
  assert_close(as_float32(got), as_float32(want), 'history')
  assert_close(model.weights, reference.weights, 'weights')  # weights synced back after fit
  assert_close(
    as_float32(model.evaluate(x, y, batch_size=16, verbose=0)),
    as_float32(reference.evaluate(x, y, batch_size=16, verbose=0)),
    'evaluate',
  )
  # The training step really ran partitioned: its shards live across the 8 devices.
  hidden = next(s for v, s in model._tf_gspmd_store.pairs() if 'h0/kernel' in v.name)
  assert hidden.sharding.spec == tg.P(None, 'model') and hidden.local_shape == (16, 8)
