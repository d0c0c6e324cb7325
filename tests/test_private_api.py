"""Private APIs are used in one place each: TensorFlow's in tf_gspmd/tf_private.py, Keras' in
tf_gspmd/keras/hooks.py.

Read from the source with `ast` (module level and inside functions alike), so a lazy import
cannot hide one. A new need for a private symbol goes into that one module, with a comment
saying why no public API serves.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / 'tf_gspmd'
TF_PRIVATE = ROOT / 'tf_private.py'
KERAS_HOOKS = ROOT / 'keras' / 'hooks.py'

# Keras' private attributes tf_gspmd reads or writes, each only in keras/hooks.py:
KERAS_PRIVATE_ATTRIBUTES = {
  '_value': "a Keras variable's tf.Variable (`.value` autocasts, and builds deferred ones)",
  '_layout': "a Keras variable's layout (Keras' JAX backend keeps it there; slots copy it)",
  '_layout_map': "ModelParallel's LayoutMap (no public accessor)",
  '_distribute_strategy': 'the tf.distribute strategy a Keras model was built in',
}
ATTRIBUTE_FUNCTIONS = ('getattr', 'hasattr', 'setattr', 'delattr')


def _sources():
  return sorted(ROOT.rglob('*.py'))


def _name(path: pathlib.Path) -> str:
  return str(path.relative_to(ROOT.parent))


def private_imports(tree, prefix: str):
  """(line, module) of each import of `prefix` or a module under it."""
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      modules = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
      # `from tensorflow import python` imports tensorflow.python too.
      modules = [f'{node.module}.{a.name}' for a in node.names]
    else:
      continue
    found += [(node.lineno, m) for m in modules if m == prefix or m.startswith(prefix + '.')]
  return found


def private_attributes(tree, names):
  """(line, name) of each `x.<name>` and each `getattr(x, '<name>', ...)` (or has/set/delattr)."""
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and node.attr in names:
      found.append((node.lineno, node.attr))
    elif (
      isinstance(node, ast.Call)
      and isinstance(node.func, ast.Name)
      and node.func.id in ATTRIBUTE_FUNCTIONS
      and len(node.args) >= 2
      and isinstance(node.args[1], ast.Constant)
      and node.args[1].value in names
    ):
      found.append((node.lineno, node.args[1].value))
  return found


def _uses(finder, allowed: pathlib.Path, *args):
  out = []
  for path in _sources():
    if path == allowed:
      continue
    tree = ast.parse(path.read_text())
    out += [f'{_name(path)}:{line}: {what}' for line, what in finder(tree, *args)]
  return out


def test_tensorflow_private_api_only_in_tf_private():
  found = _uses(private_imports, TF_PRIVATE, 'tensorflow.python')
  assert not found, (
    'import from tensorflow.python outside tf_gspmd/tf_private.py (import it from there, '
    'or use the public API that serves):\n' + '\n'.join(found)
  )


def test_keras_private_modules_only_in_hooks():
  found = _uses(private_imports, KERAS_HOOKS, 'keras.src')
  assert not found, 'keras.src imported outside tf_gspmd/keras/hooks.py:\n' + '\n'.join(found)


def test_keras_private_attributes_only_in_hooks():
  found = _uses(private_attributes, KERAS_HOOKS, set(KERAS_PRIVATE_ATTRIBUTES))
  assert not found, (
    "Keras' private attributes read outside tf_gspmd/keras/hooks.py (use its functions):\n"
    + '\n'.join(found)
  )


def test_the_two_modules_use_what_they_are_for():
  assert private_imports(ast.parse(TF_PRIVATE.read_text()), 'tensorflow.python')
  hooks = ast.parse(KERAS_HOOKS.read_text())
  assert private_imports(hooks, 'keras.src')
  assert private_attributes(hooks, set(KERAS_PRIVATE_ATTRIBUTES))


@pytest.mark.parametrize(
  'source, imports, attributes',
  [
    ('from tensorflow.python.eager import context', 1, 0),
    ('import tensorflow.python.ops.array_ops', 1, 0),
    ('def f():\n  from tensorflow.python import ops', 1, 0),
    ('from tensorflow import python', 1, 0),
    ('from tensorflow.core.framework import attr_value_pb2', 0, 0),  # TF's protos are public
    ('import tensorflow_probability', 0, 0),
    ("x = getattr(v, '_value', v)", 0, 1),
    ('v._layout = layout', 0, 1),
    ("hasattr(d, '_layout_map')", 0, 1),
    ('self._values = 1', 0, 0),  # another name
  ],
)
def test_the_scan_finds_what_it_should(source, imports, attributes):
  tree = ast.parse(source)
  assert len(private_imports(tree, 'tensorflow.python')) == imports
  assert len(private_attributes(tree, set(KERAS_PRIVATE_ATTRIBUTES))) == attributes
