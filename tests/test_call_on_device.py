"""`call_on_device` pins a call's backward ops, also those a gradient builds under
`colocate_with` (which sets the `tf.device` scope aside).

TensorFlow 2.18's gather gradient casts the table's shape inside
`ops.colocate_with(params)`: that `Cast` had no device, so an embedding pinned
to the host left one op of its backward pass to the placer. The gradient below
does the same on every TensorFlow release.
"""

from __future__ import annotations

import numpy as np

HOST = "/CPU:0"


def _traced_gradient(call):
    """The graph of d(sum(call(x)))/dx for x of shape [None, 3], and the function."""
    import tensorflow as tf

    @tf.function
    def gradient(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(call(x))
        return tape.gradient(y, x)

    concrete = gradient.get_concrete_function(tf.TensorSpec([None, 3], tf.float32))
    return concrete.graph, gradient


def _rows_times_identity():
    """x -> x, whose gradient is scaled by the number of rows, counted as TF 2.18's
    gather gradient counts them: a shape cast inside `colocate_with(x)`."""
    import tensorflow as tf

    @tf.custom_gradient
    def rows_times_identity(x):
        def backward(upstream):
            with tf.compat.v1.colocate_with(x):
                rows = tf.cast(tf.shape(x, out_type=tf.int64)[0], tf.float32)
            return upstream * rows

        return tf.identity(x), backward

    return rows_times_identity


def test_backward_ops_built_under_colocate_with_run_on_the_pinned_device():
    from keras_memfit.backend.tensorflow.placement import call_on_device

    graph, gradient = _traced_gradient(call_on_device(HOST, _rows_times_identity()))
    casts = [op for op in graph.get_operations() if op.type == "Cast"]
    assert casts, [op.type for op in graph.get_operations()]
    assert all(op.device.endswith("CPU:0") for op in casts), [(op.name, op.device) for op in casts]
    # The same gradient as without pinning: each of the 4 rows scaled by 4.
    x = np.arange(12, dtype="float32").reshape(4, 3)
    np.testing.assert_array_equal(gradient(x).numpy(), np.full((4, 3), 4.0, "float32"))


def test_without_pinning_the_colocated_op_has_no_device():
    # The reference: what the test above fixes is really there unpinned.
    graph, _ = _traced_gradient(_rows_times_identity())
    casts = [op for op in graph.get_operations() if op.type == "Cast"]
    assert casts and all(op.device == "" for op in casts)
