"""MemFit's rung after splitting: layers recomputed in the backward pass (rematerialization).

The reference is always plain Keras: `model.fit` without MemFit, from the
same initial weights and seed. Without memory pressure, `MemFit(remat=[...])`
recomputes the named blocks from the first batch and must train as plain
`fit` does, dropout and BatchNormalization included (the recomputation must
draw the forward pass's dropout masks and update the moving statistics
once: recomputing a block without passing its seed state in gives weights
about 1e-2 away, which these tests catch). Under a real limit (TensorFlow's
capped allocator; an address-space limit on JAX and torch), one sample of a
transformer (functional, or subclassed), of a Sequential conv stack, of a
functional VGG-style chain, a U-Net, MobileNetV2, EfficientNetB0 or
ResNet50 (TensorFlow) does not fit, `MemFit()` recomputes blocks until it
does, and trains as the plain `fit` without the limit.

Run directly, this file is the training script of the real-OOM test:
`python tests/test_memfit_remat.py {auto,plain} {transformer,...,resnet} OUT`.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

import keras
from keras import layers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from keras_memfit import MemFit  # noqa: E402
from keras_memfit import backend as _backend  # noqa: E402
from keras_memfit.training.remat import Rematerialization, blocks  # noqa: E402

# Recomputation changes how XLA fuses JAX's step: the same update up to rounding.
# Without memory pressure the models train with SGD: Adam turns the rounding
# noise of weights whose gradient is zero in theory (a key bias, a bias
# before BatchNormalization) into steps of the learning rate's size.
TOL = dict(rtol=1e-4, atol=2e-5) if keras.backend.backend() == "jax" else dict(rtol=1e-5, atol=1e-6)


class Block(layers.Layer):
    """A transformer block with dropout (and, optionally, BatchNormalization).

    `Block.calls` counts the calls of every block (traces, where steps are traced).
    """

    calls = 0

    def __init__(self, dim: int, batch_norm: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.attention = layers.MultiHeadAttention(4, dim // 4, dropout=0.1)
        self.dropout = layers.Dropout(0.2)
        self.hidden = layers.Dense(4 * dim, activation="gelu")
        self.out = layers.Dense(dim)
        self.norm1 = layers.LayerNormalization()
        self.norm2 = layers.LayerNormalization()
        self.batch_norm = layers.BatchNormalization() if batch_norm else None

    def call(self, x, training=None):
        Block.calls += 1
        h = self.attention(x, x, use_causal_mask=True, training=training)
        x = self.norm1(x + self.dropout(h, training=training))
        h = self.out(self.hidden(x))
        if self.batch_norm is not None:
            h = self.batch_norm(h, training=training)
        return self.norm2(x + self.dropout(h, training=training))


def transformer(length: int, dim: int, depth: int, batch_norm: bool = False,
                optimizer: str = "adam") -> keras.Model:
    """Token ids -> embedding -> `depth` blocks -> per-token logits."""
    keras.utils.set_random_seed(1)
    tokens = keras.Input((length,), dtype="int32")
    x = layers.Embedding(50, dim, name="embedding")(tokens)
    for i in range(depth):
        x = Block(dim, batch_norm, name=f"block{i}")(x)
    model = keras.Model(tokens, layers.Dense(50, name="logits")(x))
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


class Decoder(keras.Model):
    """The same transformer, subclassed: its blocks are attributes called in `call`."""

    def __init__(self, dim: int, depth: int, **kwargs):
        super().__init__(**kwargs)
        self.embedding = layers.Embedding(50, dim, name="embedding")
        self.stack = [Block(dim, name=f"block{i}") for i in range(depth)]
        self.logits = layers.Dense(50, name="logits")

    def call(self, tokens, training=None):
        x = self.embedding(tokens)
        for block in self.stack:
            x = block(x, training=training)
        return self.logits(x)


def decoder(length: int, dim: int, depth: int) -> keras.Model:
    keras.utils.set_random_seed(1)
    model = Decoder(dim, depth)
    model(np.zeros((1, length), "int32"))
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def conv_stack(size: int, channels: int, depth: int, optimizer: str = "adam") -> keras.Sequential:
    """A Sequential stack of `depth` 3x3 Conv2D(relu) layers on a `size` x `size` RGB image,
    BatchNormalization, Dropout, global average pooling and Dense(10)."""
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((size, size, 3))]
        + [layers.Conv2D(channels, 3, padding="same", activation="relu", name=f"conv{i}")
           for i in range(depth)]
        + [layers.BatchNormalization(name="norm"), layers.Dropout(0.2, name="dropout"),
           layers.GlobalAveragePooling2D(name="pool"), layers.Dense(10, name="logits")]
    )
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def _compiled(inputs, x, optimizer: str) -> keras.Model:
    """`x` (pixels) averaged to 10 logits: the model from `inputs`, compiled."""
    x = layers.GlobalAveragePooling2D(name="pool")(x)
    model = keras.Model(inputs, layers.Dense(10, name="logits")(x))
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def _conv_norm_relu(x, channels: int, name: str):
    x = layers.Conv2D(channels, 3, padding="same", use_bias=False, name=f"{name}_conv")(x)
    return layers.ReLU(name=f"{name}_relu")(layers.BatchNormalization(name=f"{name}_norm")(x))


def vgg_chain(size: int, channels: int = 8, per_stage: int = 3, stages: int = 3,
              optimizer: str = "adam") -> keras.Model:
    """A functional VGG-style chain: `stages` stages of `per_stage`
    Conv2D-BatchNormalization-ReLU blocks (`channels`, twice, four times, ...)
    and a max pooling, then Dropout."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((size, size, 3))
    x = inputs
    for stage in range(stages):
        for i in range(per_stage):
            x = _conv_norm_relu(x, channels * 2 ** stage, f"block{stage + 1}_{i + 1}")
        x = layers.MaxPooling2D(name=f"block{stage + 1}_pool")(x)
    return _compiled(inputs, layers.Dropout(0.2, name="dropout")(x), optimizer)


def unet(size: int, channels: int = 8, per_level: int = 2, optimizer: str = "adam") -> keras.Model:
    """A functional U-Net of 3 levels: `per_level` Conv2D-BatchNormalization-ReLU blocks
    each, max pooling down, upsampling up, the skips concatenated; Dropout at the bottom."""
    keras.utils.set_random_seed(1)

    def level(x, width, name):
        for i in range(per_level):
            x = _conv_norm_relu(x, width, f"{name}{i}")
        return x

    inputs = keras.Input((size, size, 3))
    skip1 = level(inputs, channels, "down1_")
    skip2 = level(layers.MaxPooling2D(name="pool1")(skip1), 2 * channels, "down2_")
    x = level(layers.MaxPooling2D(name="pool2")(skip2), 4 * channels, "bottom")
    x = layers.Dropout(0.2, name="dropout")(x)
    x = layers.Concatenate(name="cat2")([layers.UpSampling2D(name="up2")(x), skip2])
    x = level(x, 2 * channels, "up2_")
    x = layers.Concatenate(name="cat1")([layers.UpSampling2D(name="up1")(x), skip1])
    return _compiled(inputs, level(x, channels, "up1_"), optimizer)


def application(name: str, size: int, metrics=None, **options) -> keras.Model:
    """A keras.applications model (no weights; `options` to its constructor) for 10 classes,
    trained by SGD."""
    keras.utils.set_random_seed(1)
    model = getattr(keras.applications, name)(input_shape=(size, size, 3), weights=None,
                                              classes=10, classifier_activation=None, **options)
    model.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=metrics)
    return model


def _images(rows: int, size: int):
    rng = np.random.default_rng(0)
    return rng.normal(size=(rows, size, size, 3)).astype("float32"), np.arange(rows) % 10


def _data(rows: int, length: int):
    tokens = np.random.default_rng(0).integers(0, 50, (rows, length)).astype("int32")
    return tokens, np.roll(tokens, -1, axis=1)


def _fit(model, callbacks, batch_size, epochs=2, length=16):
    """Fit 8 rows: images for a conv stack, else sequences of `length` tokens."""
    shape = getattr(model, "input_shape", None)  # none on a subclassed model
    if shape is not None and len(shape) == 4:
        x, y = _images(8, shape[1])
    else:
        x, y = _data(8, length)
    keras.utils.set_random_seed(7)
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False,
                        verbose=0, callbacks=callbacks)
    return [keras.ops.convert_to_numpy(v) for v in model.variables], history.history


def _assert_trained_alike(got, expected):
    (weights, history), (ref_weights, ref_history) = got, expected
    for key, values in ref_history.items():
        np.testing.assert_allclose(history[key], values, err_msg=key, **TOL)
    assert len(weights) == len(ref_weights)
    for w, ref in zip(weights, ref_weights):
        np.testing.assert_allclose(w, ref, **TOL)


@pytest.fixture
def checkpoints(monkeypatch):
    """Counts the functions made with the backend's `checkpoint`."""
    module = _backend.get()
    made = []
    original = module.checkpoint

    def counting(fn):
        made.append(fn)
        return original(fn)

    monkeypatch.setattr(module, "checkpoint", counting)
    return made


@pytest.mark.parametrize("batch_norm", [False, True], ids=["dropout", "dropout+batchnorm"])
def test_forced_remat_trains_as_plain_fit(batch_norm, checkpoints):
    reference = _fit(transformer(16, 16, 2, batch_norm, "sgd"), [], batch_size=4)
    model = transformer(16, 16, 2, batch_norm, "sgd")
    got = _fit(model, [MemFit(remat=["block0", "block1"])], batch_size=4)
    assert checkpoints, "no layer was recomputed"
    _assert_trained_alike(got, reference)
    assert all("call" not in vars(layer) for layer in model.layers), "calls not put back"


def test_every_run_of_a_sequential_recomputed_trains_as_plain_fit(checkpoints, monkeypatch):
    reference = _fit(conv_stack(12, 8, 6, "sgd"), [], batch_size=4)
    model = conv_stack(12, 8, 6, "sgd")
    monkeypatch.setattr(Rematerialization, "_chosen", lambda self, signature: self._candidates())
    memfit = MemFit()
    got = _fit(model, [memfit], batch_size=4)
    runs = len(blocks(model)[0])
    assert runs > 1 and checkpoints and len(checkpoints) % runs == 0  # each run, each trace
    _assert_trained_alike(got, reference)
    assert "call" not in vars(model), "the Sequential's call not put back"


@pytest.mark.parametrize("make", [vgg_chain, unet], ids=["vgg-chain", "unet"])
def test_functional_conv_model_with_every_segment_recomputed_trains_as_plain_fit(
        make, checkpoints, monkeypatch):
    reference = _fit(make(16, optimizer="sgd"), [], batch_size=4)
    model = make(16, optimizer="sgd")
    monkeypatch.setattr(Rematerialization, "_chosen", lambda self, signature: self._candidates())
    got = _fit(model, [MemFit()], batch_size=4)
    segments = len(blocks(model)[0])
    assert segments > 1 and checkpoints and len(checkpoints) % segments == 0
    _assert_trained_alike(got, reference)
    assert "call" not in vars(model), "the model's call not put back"


def _nested_model(optimizer: str = "sgd") -> keras.Model:
    """Tokens -> a nested functional backbone (embedding, 2 transformer blocks named
    decoder_block_i) -> logits."""
    keras.utils.set_random_seed(1)
    tokens = keras.Input((16,), dtype="int32")
    x = layers.Embedding(50, 16, name="token_embedding")(tokens)
    for i in range(2):
        x = Block(16, name=f"decoder_block_{i}")(x)
    backbone = keras.Model(tokens, x, name="backbone")
    inputs = keras.Input((16,), dtype="int32")
    model = keras.Model(inputs, layers.Dense(50, name="logits")(backbone(inputs)))
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_layers_inside_a_nested_model_are_found_and_can_be_named(checkpoints):
    from keras_memfit import memory_report

    model = _nested_model()
    found, _ = blocks(model)
    assert sorted(b.layers[0].name for b in found) == ["decoder_block_0", "decoder_block_1"]
    report = memory_report(model, batch_size=2)
    frees = {row.name: (row.remat_bytes, row.remat_layers) for row in report.rows}
    assert frees["backbone"] == (2 * sum(b.saving for b in found), 2)  # shown on its row
    reference = _fit(_nested_model(), [], batch_size=4)
    got = _fit(_nested_model(), [MemFit(remat=["decoder_block_1"])], batch_size=4)
    assert checkpoints, "no layer was recomputed"
    _assert_trained_alike(got, reference)


def test_sequential_of_nested_inputs_recomputes_its_blocks(checkpoints):
    """A Sequential whose first layer takes two inputs has no graph to cut; its
    blocks are recomputed as layers are (it raised AttributeError once chosen)."""

    class Sum(layers.Layer):
        def call(self, inputs):
            return inputs[0] + inputs[1]

    def make():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([Sum(), Block(16, name="block0"), layers.Dense(50)])
        model([np.zeros((1, 16, 16), "float32")] * 2)
        model.compile(optimizer="sgd",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    def fit(model, callbacks):
        x = np.random.default_rng(0).normal(size=(8, 16, 16)).astype("float32")
        keras.utils.set_random_seed(7)
        history = model.fit([x, x], np.arange(8 * 16).reshape(8, 16) % 50, batch_size=4,
                            epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
        return [keras.ops.convert_to_numpy(v) for v in model.variables], history.history

    assert [b.layers[0].name for b in blocks(make())[0]] == ["block0"]
    reference = fit(make(), [])
    got = fit(make(), [MemFit(remat=["block0"])])
    assert checkpoints, "no layer was recomputed"
    _assert_trained_alike(got, reference)


@pytest.mark.parametrize("name", ["ResNet50", "MobileNetV2", "EfficientNetB0", "VGG16"])
def test_keras_applications_backbones_are_cut_into_segments(name):
    keras.utils.set_random_seed(1)
    model = getattr(keras.applications, name)(weights=None, include_top=False,
                                              input_shape=(32, 32, 3))
    found, _ = blocks(model)
    assert len(found) > 1
    spans = sorted(b.span for b in found)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans  # in order, apart
    inside = [id(layer) for block in found for layer in block.layers]
    assert len(set(inside)) == len(inside) and set(inside) <= {id(l) for l in model.layers}
    assert all(block.saving > 0 for block in found)


def test_a_recomputed_segment_copies_only_the_state_it_assigns(checkpoints, monkeypatch):
    """A segment holding a LoRA layer (its kernel frozen: non-trainable, never
    assigned), Dropout and BatchNormalization: their seed and statistics are
    copied (torch assigns in place; the recomputation reads the start), the
    frozen kernel never, and the model trains as plain `fit`."""

    def make():
        keras.utils.set_random_seed(1)
        tokens = keras.Input((16,), dtype="int32")
        x = layers.Embedding(50, 16, name="embedding")(tokens)
        adapted = layers.Dense(24, name="adapted")
        x = layers.BatchNormalization(name="norm")(layers.Dropout(0.2)(adapted(x)))
        x = layers.Dense(16, activation="relu", name="hidden")(x)
        model = keras.Model(tokens, layers.Dense(50, name="logits")(x))
        adapted.enable_lora(2)
        model.compile(optimizer="sgd",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    reference = _fit(make(), [], batch_size=4)
    copied = []
    copy = keras.ops.copy
    monkeypatch.setattr(keras.ops, "copy", lambda x: copied.append(tuple(x.shape)) or copy(x))
    monkeypatch.setattr(Rematerialization, "_chosen", lambda self, signature: self._candidates())
    model = make()
    got = _fit(model, [MemFit()], batch_size=4)
    assert "adapted" in [layer.name for block in blocks(model)[0] for layer in block.layers]
    assert checkpoints and copied and (16, 24) not in copied, copied  # seeds, statistics only
    _assert_trained_alike(got, reference)


def test_named_consecutive_layers_of_a_graph_are_recomputed_as_one_segment(checkpoints):
    names = ["block1_1_conv", "block1_1_norm", "block1_1_relu", "block1_2_conv"]
    model = vgg_chain(16, optimizer="sgd")
    remat = Rematerialization(model, names)
    assert remat.apply("signature") == tuple(names)
    # The model runs its graph as parts, one of them recomputed; no layer is wrapped alone.
    assert "call" in vars(model) and all("call" not in vars(layer) for layer in model.layers)
    remat.release()
    reference = _fit(vgg_chain(16, optimizer="sgd"), [], batch_size=4)
    got = _fit(vgg_chain(16, optimizer="sgd"), [MemFit(remat=names)], batch_size=4)
    assert checkpoints, "no layer was recomputed"
    _assert_trained_alike(got, reference)


def test_subclassed_model_trains_as_plain_fit_with_its_blocks_recomputed(checkpoints):
    reference = _fit(decoder(16, 16, 2), [], batch_size=4)
    got = _fit(decoder(16, 16, 2), [MemFit(remat=["block0", "block1"])], batch_size=4)
    assert checkpoints, "no layer was recomputed"
    _assert_trained_alike(got, reference)


def test_without_memory_pressure_nothing_is_recomputed_or_analysed(checkpoints):
    from keras_memfit.training import remat as _remat

    reference = _fit(transformer(16, 16, 2, optimizer="sgd"), [], batch_size=4)
    # The blocks' calls (traces on TensorFlow and JAX, every step on torch) as without the rung.
    Block.calls = 0
    _fit(transformer(16, 16, 2, optimizer="sgd"), [MemFit(remat=False)], batch_size=4)
    without_rung, Block.calls = Block.calls, 0
    model = transformer(16, 16, 2, optimizer="sgd")
    memfit = MemFit()  # remat="auto"
    got = _fit(model, [memfit], batch_size=4)
    assert checkpoints == [] and model not in _remat._BLOCKS and memfit.events == []
    assert Block.calls == without_rung
    _assert_trained_alike(got, reference)


def test_a_functional_conv_model_without_memory_pressure_recomputes_nothing(checkpoints):
    from keras_memfit.training import remat as _remat

    reference = _fit(unet(16, optimizer="sgd"), [], batch_size=4)
    model = unet(16, optimizer="sgd")
    memfit = MemFit()
    got = _fit(model, [memfit], batch_size=4)
    assert checkpoints == [] and model not in _remat._BLOCKS and memfit.events == []
    assert "call" not in vars(model)
    _assert_trained_alike(got, reference)


def test_blocks_rank_the_transformer_blocks_first():
    model = transformer(32, 16, 3)
    found, flops = blocks(model)
    assert sorted(b.layers[0].name for b in found[:3]) == ["block0", "block1", "block2"]
    assert found[0].saving > 0 and flops > 0
    # By hand (L=32 tokens, d=16, 4 heads of 4): projections 4 x 2Ld^2, scores
    # and weighted sum 2 x 2 x 4 x L^2 x 4, softmax 4L^2, the MLP 2 x 2L x d x 4d,
    # two LayerNormalizations 2 x 2Ld.
    length, dim = 32, 16
    by_hand = (8 * length * dim**2 + 64 * length**2 + 4 * length**2
               + 16 * length * dim**2 + 4 * length * dim)
    assert found[0].flops == by_hand


def test_blocks_cut_a_sequential_where_every_segment_recomputed_holds_least():
    model = conv_stack(16, 8, 9)  # 13 layers; 16 x 16 x 8 floats (u) out of each conv and norm
    found, _ = blocks(model)
    segments = sorted([layer.name for layer in block.layers] for block in found)
    # By hand, every segment recomputed: the backward pass of a segment holds what
    # the segments before it keep (one u each) and what it makes inside again;
    # the largest of these is 4u at the least (11 u out of 13 layers), and later
    # segments are shorter, since more is kept before them. Logits alone frees nothing.
    assert segments == [[f"conv{i}" for i in range(4)], ["conv4", "conv5", "conv6"],
                        ["conv7", "conv8"], ["norm", "dropout", "pool"]]
    u = 16 * 16 * 8 * 4
    assert sorted(b.saving for b in found) == [u, u, 2 * u, 3 * u]


def test_memory_report_shows_what_recomputing_frees():
    from keras_memfit import memory_report

    report = memory_report(transformer(64, 16, 2), batch_size=4)
    frees = {row.name: row.remat_bytes for row in report.rows}
    assert frees["block0"] > 0 and frees["block0"] == frees["block1"]
    assert frees["embedding"] == 0 and frees["logits"] == 0  # nothing inside to recompute
    assert "Remat frees" in str(report)
    # A Sequential: on each segment's first layer, the outputs inside it (conv0 to
    # conv3: 3 conv outputs of 16 x 16 x 8 floats, 4 samples), and its layers.
    report = memory_report(conv_stack(16, 8, 9), batch_size=4)
    frees = {row.name: (row.remat_bytes, row.remat_layers) for row in report.rows}
    u = 4 * 16 * 16 * 8 * 4
    assert frees["conv0"] == (3 * u, 4) and frees["conv4"] == (2 * u, 3)
    assert frees["conv1"] == frees["logits"] == (0, 0)
    assert "(4 layers)" in str(report)


def test_escalation_doubles_until_every_block():
    model = transformer(16, 16, 3)
    remat = Rematerialization(model, "auto")
    counts = []
    while remat.escalate("sig"):
        counts.append(len(remat.names("sig")))
    assert counts[:2] == [1, 2] and counts[-1] == len(blocks(model)[0])
    assert remat.apply("other") == ()  # per signature
    assert not Rematerialization(model, False).escalate("sig")


@pytest.mark.parametrize("remat", ["always", True, [], [3], "block0"])
def test_remat_argument_is_checked(remat):
    with pytest.raises(ValueError, match="remat must be"):
        MemFit(remat=remat)


def test_unknown_layer_name_is_named():
    model = transformer(16, 16, 1)
    with pytest.raises(ValueError, match="nope"):
        _fit(model, [MemFit(remat=["nope"])], batch_size=4, epochs=1)


@pytest.mark.memory_cap(64)
def test_one_layer_whose_backward_pass_does_not_fit_is_named_without_recomputing():
    """A 3x3 Conv2D(32) on a 32-channel 256 x 256 image: its gradients on
    TensorFlow's CPU kernels need its column matrix (72 MiB) beyond its tensors
    (32 MiB with their gradients), more than the 64 MiB cap holds; no
    recomputation of other layers can help, and MemFit says so at once."""
    from keras_memfit import OutOfMemoryError

    keras.utils.set_random_seed(1)
    inputs = keras.Input((256, 256, 3))
    x = layers.Conv2D(32, 3, padding="same", name="conv0")(inputs)
    x = layers.Conv2D(32, 3, padding="same", name="conv1")(x)
    model = _compiled(inputs, x, "sgd")
    x, y = _images(1, 256)
    memfit = MemFit()
    with pytest.raises(OutOfMemoryError) as caught:
        model.fit(x, y, batch_size=1, verbose=0, callbacks=[memfit])
    err = caught.value
    assert err.cause == "one_layer" and err.layer == "conv1", str(err)
    assert "column matrix of 72.0 MiB" in str(err) and "MiB free on CPU:0" in str(err), str(err)
    assert not [e for e in memfit.events if e["kind"] == "remat"], memfit.events


# ------------------------------------------------------------- real OOMs
# Per model kind and backend: its size, and how memory runs out. TensorFlow:
# the capped BFC allocator (the transformer's one sample: ~259 MiB plain, ~83
# with every block recomputed; the conv stack trains plain at 130 MiB, at 100
# only with 8 layers recomputed). JAX and torch: an address-space limit set
# in the child once the model is built, at what it maps then plus a budget
# (so TensorFlow's own mappings, where Keras imports it, do not count).
# Measured on torch: plain `fit` of the functional transformer fits at 960
# MiB and trains at 900 with one block recomputed.
#
# Not run (KINDS), measured: the conv stack on JAX (under an address-space
# limit, XLA's CPU convolutions abort the process with std::bad_alloc where
# the step does not fit, recomputed or not: 384 x 384, 8 channels, 36
# layers, budgets 400-550 MiB). On torch the windows are not reproducible:
# the conv stack (same size) fits plain at 700 MiB and trains at 640 with 24
# layers recomputed in one run, not even with all 40 in the next; the
# subclassed transformer fits plain at 600 in one child and fails at 580
# with every block recomputed in another.
LENGTH = {"tensorflow": 1024, "jax": 2048, "torch": 2048}
# Functional conv models, TensorFlow only: cut by their graph. Measured on the
# capped allocator (2 cores; the smallest cap that trains, plain / with every
# segment recomputed): the VGG-style chain (a 256 x 256 image, 24
# Conv2D(16)-BatchNormalization-ReLU blocks) 243 / 118 MiB; the U-Net (256 x
# 256, 6 blocks a level) 180 / 120; keras.applications' MobileNetV2 (alpha
# 0.35, 384 x 384) 127 / 78. MemFit needs 3-4 rungs at these caps. Not run:
# MobileNetV2 at 224 x 224 (plain 70-82 MiB from run to run, 57 recomputed:
# no steady window).
FUNCTIONAL = {"tensorflow": ("chain", "unet", "mobilenet")}
# keras.applications whose weights weigh (SGD, a step's update waiting for
# every gradient only where one sample's activations outweigh them: see
# `backend/tensorflow/training.TrainStep`), run apart (`APPLICATIONS`):
# EfficientNetB0 at 224 x 224 (16 MB of gradients; plain trains one sample
# under 180 MiB, not under 140) and ResNet50 at 320 x 320 (94 MB; plain
# trains under 350 MiB, not under 320). Not run: ResNet50 at 160 x 160,
# where its gradients outweigh one sample's activations (81 / 76 MiB).
APPLICATIONS = {"tensorflow": ("efficientnet", "resnet")}
GRAPHS = FUNCTIONAL["tensorflow"] + APPLICATIONS["tensorflow"]
# The functional conv models (BatchNormalization at batch 1, 24 layers deep)
# amplify float rounding: MemFit's step and Keras's run the same ops in
# another order, and their weights end up to 1.8% of the change training
# made apart (the chain; 1.3e-4 on its first kernel), as Keras's own step
# does from itself when TensorFlow runs two ops at a time. A wrong gradient
# or a dropout mask drawn again moves a weight by about its whole change.
CHANGE_SHARE = 0.05
DIM = {"tensorflow": 128, "jax": 64, "torch": 64}
DEPTH = 4
CONV = {"tensorflow": (256, 16, 16)}
KINDS = {"tensorflow": ("transformer", "subclassed", "conv"),
         "jax": ("transformer", "subclassed"), "torch": ("transformer",)}
CAP_MB = {"transformer": 180, "subclassed": 180, "conv": 100, "chain": 160, "unet": 140,
          "mobilenet": 100, "efficientnet": 140, "resnet": 320}
BUDGET_MB = {
    "transformer": {"jax": 1280, "torch": 900},
    "subclassed": {"jax": 1280},
    "conv": {},
    "chain": {},
    "unet": {},
    "mobilenet": {},
    "efficientnet": {},
    "resnet": {},
}


def _run(mode: str, kind: str, tmp_path) -> tuple:
    """This file as a child (`_main`): the weights it wrote, and its History and events."""
    from tests.child import run_child

    backend = keras.backend.backend()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_CPU_")}
    env.update(TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2",
               KERAS_BACKEND=backend, PYTHONPATH=ROOT)
    # One malloc arena: each thread's own maps 64 MiB, and whether a step fits
    # under an address-space limit would depend on the threads that ran.
    env.update(MALLOC_ARENA_MAX="1")
    # One thread per TensorFlow op and one op at a time: otherwise sums run in
    # an order that varies from run to run (two plain fits of the chain end
    # 1.5e-4 apart); see `CHANGE_SHARE` for what remains.
    env.update(TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1")
    if mode == "auto" and backend == "tensorflow":
        env.update(TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPU_BFC_MEM_LIMIT_IN_MB=str(CAP_MB[kind]))
    out = str(tmp_path / f"{mode}-{kind}")
    proc = run_child([os.path.abspath(__file__), mode, kind, out], env=env, timeout=1200)
    assert proc.returncode == 0, kind + ": " + proc.stdout[-3000:] + proc.stderr[-6000:]
    with open(out + ".json") as f:
        result = json.load(f)
    with np.load(out + ".npz") as arrays:
        count = len(arrays.files) // 2
        weights = [arrays[f"w{i}"] for i in range(count)]
        result["initial"] = [arrays[f"i{i}"] for i in range(count)]
    return weights, result


def _run_all(kinds, tmp_path) -> dict:
    """Each kind capped ("auto") and plain, every child at once: the capped ones
    mostly wait (TensorFlow's allocator waits about 10 s per OOM). Each trained
    by MemFit as plain `fit` uncapped, through the rung."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(mode, kind) for kind in kinds for mode in ("auto", "plain")]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = dict(zip(jobs, pool.map(lambda job: _run(*job, tmp_path), jobs)))
    for kind in kinds:
        (weights, got), (ref_weights, expected) = results["auto", kind], results["plain", kind]
        assert not expected["events"], (kind, expected["events"])  # a reference recomputes nothing
        remat = [e for e in got["events"] if e["kind"] == "remat"]
        assert remat and remat[-1]["layers"], (kind, got["events"])
        assert got["history"]["memfit_remat"] == [len(remat[-1]["layers"])], kind
        if kind in GRAPHS:
            for key, values in expected["history"].items():
                np.testing.assert_allclose(got["history"][key], values, rtol=1e-4, err_msg=key)
            _assert_trained_within_rounding(weights, ref_weights, expected["initial"], kind)
        else:
            _assert_trained_alike((weights, got["history"]), (ref_weights, expected["history"]))
    return results


def _assert_trained_within_rounding(weights, ref_weights, initial, kind: str) -> None:
    """Each weight within `CHANGE_SHARE` of the change plain `fit` made to it."""
    assert len(weights) == len(ref_weights) == len(initial), kind
    for w, ref, w0 in zip(weights, ref_weights, initial):
        change = float(np.max(np.abs(ref - w0), initial=0.0))
        gap = float(np.max(np.abs(w - ref), initial=0.0))
        assert gap <= max(CHANGE_SHARE * change, TOL["atol"]), (kind, w.shape, gap, change)


def test_one_sample_that_does_not_fit_trains_as_plain_fit(tmp_path):
    """MemFit recomputes blocks until one sample fits, and trains as plain `fit` uncapped:
    a functional transformer, the same subclassed, a Sequential conv stack and, on
    TensorFlow, functional conv models of nothing but plain layers, cut by their
    graph: a VGG-style chain, a U-Net with skips, keras.applications' MobileNetV2."""
    backend = keras.backend.backend()
    results = _run_all(KINDS[backend] + FUNCTIONAL.get(backend, ()), tmp_path)
    if backend == "tensorflow":
        # Without the rung MemFit gives up; with all of it too, here, and the
        # model that ran out of memory in its recomputing step is intact.
        got = results["auto", "transformer"][1]
        assert got["off"].startswith("OutOfMemoryError"), got["off"]
        assert "already recomputed 4 layer(s)" in got["all"], got["all"]
        assert got["all_intact"], "the model changed in the step that ran out of memory"


@pytest.mark.skipif(keras.backend.backend() not in APPLICATIONS, reason="TensorFlow's cap only")
def test_keras_applications_whose_one_sample_does_not_fit_train_as_plain_fit(tmp_path):
    """keras.applications' EfficientNetB0 and ResNet50, their weights heavy beside one sample's
    activations, through the rung (run apart: each retraces a large model several times)."""
    _run_all(APPLICATIONS[keras.backend.backend()], tmp_path)


def _limit_memory(backend: str, kind: str) -> None:
    """Where memory is limited by address space: what is mapped now plus the budget."""
    if backend not in BUDGET_MB[kind]:
        return
    import ctypes
    import resource

    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what building the model freed: not counted
    with open("/proc/self/status") as f:
        mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
    limit = mapped + BUDGET_MB[kind][backend] * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _model_and_data(kind: str, backend: str, rows: int):
    if kind == "chain":
        return vgg_chain(256, 16, per_stage=24, stages=1, optimizer="sgd"), _images(rows, 256)
    if kind == "unet":
        return unet(256, per_level=6, optimizer="sgd"), _images(rows, 256)
    if kind == "mobilenet":
        model = application("MobileNetV2", 384, metrics=["accuracy"], alpha=0.35)
        return model, _images(rows, 384)
    if kind in ("efficientnet", "resnet"):
        name, size = ("EfficientNetB0", 224) if kind == "efficientnet" else ("ResNet50", 320)
        return application(name, size), _images(rows, size)
    if kind == "conv":
        size, channels, depth = CONV[backend]
        return conv_stack(size, channels, depth), _images(rows, size)
    make = transformer if kind == "transformer" else decoder
    return make(LENGTH[backend], DIM[backend], DEPTH), _data(rows, LENGTH[backend])


def _values(model):
    return [keras.ops.convert_to_numpy(v) for v in model.variables]


def _main(mode: str, kind: str, out: str) -> None:
    """Train one sample per batch; write weights, History and events (`mode` "auto":
    under the memory limit, with MemFit; "plain": without either; on TensorFlow's
    transformer after trying `MemFit(remat=False)` there, and every block
    recomputed at twice the length)."""
    from keras_memfit import OutOfMemoryError

    backend = keras.backend.backend()
    model, (x, y) = _model_and_data(kind, backend, 2 if backend == "tensorflow" else 1)
    keras.utils.set_random_seed(7)
    result = {}
    if mode == "auto":
        _limit_memory(backend, kind)
    if mode == "auto" and backend == "tensorflow" and kind == "transformer":
        length, dim = LENGTH[backend], DIM[backend]
        off = transformer(length, dim, DEPTH)
        try:  # without the rung, MemFit gives up
            off.fit(x, y, batch_size=1, verbose=0, callbacks=[MemFit(remat=False)])
            result["off"] = "trained"
        except OutOfMemoryError as err:
            result["off"] = f"OutOfMemoryError: {err}"
        big = transformer(length * 2, dim, DEPTH)  # too long with every block recomputed
        before = _values(big)
        try:
            big.fit(np.tile(x, 2), np.tile(y, 2), batch_size=1, verbose=0,
                    callbacks=[MemFit(remat=[f"block{i}" for i in range(DEPTH)])])
            result["all"] = "trained"
        except OutOfMemoryError as err:
            result["all"] = str(err)
        result["all_intact"] = all(np.array_equal(a, b) for a, b in zip(before, _values(big)))
        del off, big
    memfit = MemFit()
    initial = _values(model)
    keras.utils.set_random_seed(7)
    history = model.fit(x, y, batch_size=1, epochs=1, shuffle=False, verbose=0,
                        callbacks=[memfit] if mode == "auto" else [])
    result.update(history=history.history, events=memfit.events)
    np.savez(out + ".npz", **{f"w{i}": w for i, w in enumerate(_values(model))},
             **{f"i{i}": w for i, w in enumerate(initial)})
    with open(out + ".json", "w") as f:
        json.dump(result, f, default=str)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2], sys.argv[3])
