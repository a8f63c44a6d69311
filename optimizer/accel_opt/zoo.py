"""Example models generated deterministically in code (no downloads): the demo, tests and benchmarks.

`resnet()` builds a ResNet-50-layout classifier (bottleneck blocks, batch norm folded into conv
biases, as inference exporters emit it) with seeded He-initialised weights. Residual branches are
scaled down so activations stay bounded through depth, as trained networks' are. Its classifier can
be trained on `photo_dataset()`: crops of real photos labelled with the photo they came from.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

RESNET50_LAYOUT = (3, 4, 6, 3)
OPSET = 17


class _Graph:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.count = 0

    def name(self, kind: str) -> str:
        self.count += 1
        return f"{kind}_{self.count}"

    def const(self, kind: str, array: np.ndarray) -> str:
        name = self.name(kind)
        self.inits.append(numpy_helper.from_array(array.astype(np.float32), name))
        return name

    def conv(self, x: str, c_in: int, c_out: int, k: int, stride: int = 1, gain: float = 1.0, relu: bool = True) -> str:
        std = gain * np.sqrt(2.0 / (c_in * k * k))
        w = self.const("W", self.rng.normal(0, std, (c_out, c_in, k, k)))
        b = self.const("B", self.rng.normal(0, 0.01, (c_out,)))
        y = self.name("conv")
        self.nodes.append(
            helper.make_node("Conv", [x, w, b], [y], name=y, kernel_shape=[k, k], strides=[stride, stride],
                             pads=[k // 2] * 4)
        )
        return self.relu(y) if relu else y

    def const_int(self, kind: str, array: np.ndarray) -> str:
        name = self.name(kind)
        self.inits.append(numpy_helper.from_array(array.astype(np.int64), name))
        return name

    def relu(self, x: str) -> str:
        y = self.name("relu")
        self.nodes.append(helper.make_node("Relu", [x], [y], name=y))
        return y

    def add(self, a: str, b: str) -> str:
        y = self.name("add")
        self.nodes.append(helper.make_node("Add", [a, b], [y], name=y))
        return y


def resnet(
    layout: tuple[int, ...] = RESNET50_LAYOUT,
    width: int = 64,
    num_classes: int | None = None,
    image_size: int = 224,
    seed: int = 0,
    dynamic_batch: bool = True,
    head_training: tuple[list[dict[str, np.ndarray]], np.ndarray] | None = None,
) -> onnx.ModelProto:
    """A bottleneck ResNet (ResNet-50 with the defaults) as an ONNX model with input `image`, output `logits`.

    The body keeps its random weights. With `head_training=(samples, labels)` (see `photo_dataset`),
    the classifier is trained on those images' features (see `_train_head`), so its logits have the
    class margins of a trained classifier; without it the head is random and 1000 classes wide.
    """
    if num_classes is None:
        num_classes = int(head_training[1].max()) + 1 if head_training else 1000
    g = _Graph(seed)
    x = g.conv("image", 3, width, 7, stride=2)
    pooled = g.name("maxpool")
    g.nodes.append(helper.make_node("MaxPool", [x], [pooled], name=pooled, kernel_shape=[3, 3], strides=[2, 2],
                                    pads=[1] * 4))
    x, c_in = pooled, width
    for stage, blocks in enumerate(layout):
        mid = width * 2**stage
        c_out = mid * 4
        for block in range(blocks):
            stride = 2 if stage > 0 and block == 0 else 1
            y = g.conv(x, c_in, mid, 1)
            y = g.conv(y, mid, mid, 3, stride=stride)
            y = g.conv(y, mid, c_out, 1, gain=0.3, relu=False)
            shortcut = g.conv(x, c_in, c_out, 1, stride=stride, relu=False) if block == 0 else x
            x, c_in = g.relu(g.add(y, shortcut)), c_out
    gap, flat, logits = g.name("gap"), g.name("flatten"), "logits"
    g.nodes.append(helper.make_node("GlobalAveragePool", [x], [gap], name=gap))
    g.nodes.append(helper.make_node("Flatten", [gap], [flat], name=flat, axis=1))
    fc_w = g.const("fc_W", g.rng.normal(0, np.sqrt(1.0 / c_in), (num_classes, c_in)))
    fc_b = g.const("fc_B", np.zeros(num_classes))
    g.nodes.append(helper.make_node("Gemm", [flat, fc_w, fc_b], [logits], name="fc", transB=1))
    batch = "batch" if dynamic_batch else 1
    graph = helper.make_graph(
        g.nodes,
        "resnet",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [batch, 3, image_size, image_size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, num_classes])],
        g.inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="accel-opt.zoo")
    model.ir_version = 8
    onnx.checker.check_model(model)
    if head_training:
        _train_head(model, flat, fc_w, fc_b, *head_training)
    return model


YOLO_STRIDES = (8, 16, 32)


def detector(image_size: int = 640, num_classes: int = 8, width: int = 16, seed: int = 0,
             score_bias: float = -6.0, score_gain: float = 1.0) -> onnx.ModelProto:
    """A detector in YOLOv8's export layout: image [batch, 3, S, S] (RGB / 255) -> `output0` [batch, 4 + classes,
    anchors], boxes as (cx, cy, w, h) in input pixels and class scores after a sigmoid, at strides 8, 16 and 32
    (8400 anchors at 640). A stride-2 SiLU backbone with residual blocks (widths `width` x 1..16) and a 3x3 + 1x1 head
    per scale, seeded random weights: about 3.4 GFLOP per image at 640 with the defaults, of YOLOv8n's 8.7. A class's
    logits are normalized over the image and set to N(`score_bias`, `score_gain`): only the regions that excite its
    filters most pass a 0.25 threshold (tens of boxes per photo after NMS with the defaults)."""
    g = _Graph(seed)

    def silu(x: str) -> str:
        s, y = g.name("sigmoid"), g.name("silu")
        g.nodes += [helper.make_node("Sigmoid", [x], [s], name=s), helper.make_node("Mul", [x, s], [y], name=y)]
        return y

    def conv(x: str, c_in: int, c_out: int, k: int = 3, stride: int = 1, act: bool = True) -> str:
        y = g.conv(x, c_in, c_out, k, stride=stride, relu=False)
        return silu(y) if act else y

    def block(x: str, c: int) -> str:
        return g.add(x, conv(conv(x, c, c), c, c, act=False))

    def op(kind: str, inputs: list[str], **attrs) -> str:
        y = g.name(kind.lower())
        g.nodes.append(helper.make_node(kind, inputs, [y], name=y, **attrs))
        return y

    x, c = conv("image", 3, width, stride=2), width
    features = []
    for level in range(1, 5):  # strides 4, 8, 16, 32
        x, c = conv(x, c, c * 2, stride=2), c * 2
        x = block(x, c)
        if level >= 2:
            features.append((x, c))
    # YOLOv8's head: each scale's raw box and class maps concatenated, flattened and joined over the scales, then
    # decoded at once, the boxes in pixels and the scores after a sigmoid concatenated into the one output.
    raw, grids, strides = [], [], []
    for (feature, c_in), stride in zip(features, YOLO_STRIDES):
        cells, hidden_c = image_size // stride, max(c_in // 2, 32)
        hidden = conv(feature, c_in, hidden_c)
        box = conv(hidden, hidden_c, 4, k=1, act=False)
        # Class logits normalized per image and class over the positions (InstanceNormalization), then N(bias, gain):
        # a class fires where the image excites its filters most, whatever the photo's overall brightness.
        logits = op("InstanceNormalization", [conv(hidden, hidden_c, num_classes, k=1, act=False),
                                              g.const("gain", np.full(num_classes, score_gain)),
                                              g.const("bias", np.full(num_classes, score_bias))])
        flat = g.const_int("shape", np.array([0, 4 + num_classes, cells * cells]))
        raw.append(op("Reshape", [op("Concat", [box, logits], axis=1), flat]))
        grids.append(np.stack(np.meshgrid(np.arange(cells), np.arange(cells)), 0).reshape(2, cells * cells))
        strides.append(np.full(cells * cells, float(stride)))
    joined = op("Concat", raw, axis=2)
    txy, twh, cls = g.name("txy"), g.name("twh"), g.name("cls")
    g.nodes.append(helper.make_node("Split", [joined, g.const_int("split", np.array([2, 2, num_classes]))],
                                    [txy, twh, cls], name=g.name("split"), axis=1))
    stride_map = g.const("strides", np.concatenate(strides)[None, None])
    # (cx, cy) = (grid + sigmoid) * stride; (w, h) = stride * 4 * sigmoid^2 (up to 4 cells), as YOLOv5 decodes
    xy = op("Mul", [op("Add", [op("Sigmoid", [txy]), g.const("grid", np.concatenate(grids, 1)[None])]), stride_map])
    wh_sig = op("Sigmoid", [twh])
    wh = op("Mul", [op("Mul", [wh_sig, wh_sig]), op("Mul", [stride_map, g.const("four", np.array(4.0))])])
    g.nodes.append(helper.make_node("Concat", [xy, wh, op("Sigmoid", [cls])], ["output0"], name="heads", axis=1))
    graph = helper.make_graph(
        g.nodes, "detector",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 3, image_size, image_size])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT,
                                       ["batch", 4 + num_classes, sum((image_size // s) ** 2 for s in YOLO_STRIDES)])],
        g.inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="accel-opt.zoo")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _train_head(
    model: onnx.ModelProto, features: str, fc_w: str, fc_b: str, samples, labels: np.ndarray,
    components: int = 32, l2: float = 1e-3, steps: int = 2000, learning_rate: float = 0.5,
) -> None:
    """Train the classifier (softmax regression) on the body's features of `samples`.

    Random deep features share one dominant direction; the head reads the leading `components`
    principal directions of the centred features, standardised, so the fit neither sees that
    common offset nor divides by near-zero variances (which would amplify any noise). The result is
    a trained linear classifier with real margins. Written out because it is ten lines of numpy
    and scikit-learn is not a dependency.
    """
    import onnxruntime as ort

    tapped = onnx.ModelProto()
    tapped.CopyFrom(model)
    tapped.graph.output.append(helper.make_tensor_value_info(features, TensorProto.FLOAT, None))
    session = ort.InferenceSession(tapped.SerializeToString(), providers=["CPUExecutionProvider"])
    feats = np.concatenate([session.run([features], s)[0] for s in samples]).astype(np.float64)
    mean = feats.mean(axis=0)
    _, _, directions = np.linalg.svd(feats - mean, full_matrices=False)
    projection = directions[:components]
    coords = (feats - mean) @ projection.T
    scale = coords.std(axis=0) + 1e-12
    coords /= scale
    inits = {t.name: t for t in model.graph.initializer}
    num_classes = numpy_helper.to_array(inits[fc_w]).shape[0]
    targets = np.eye(num_classes)[labels]
    weight, bias = np.zeros((num_classes, coords.shape[1])), np.zeros(num_classes)
    for _ in range(steps):  # full-batch gradient descent on the cross-entropy
        logits = coords @ weight.T + bias
        prob = np.exp(logits - logits.max(axis=1, keepdims=True))
        prob /= prob.sum(axis=1, keepdims=True)
        grad = (prob - targets) / len(coords)
        weight -= learning_rate * (grad.T @ coords + l2 * weight)
        bias -= learning_rate * grad.sum(axis=0)
    fc = (weight / scale) @ projection  # back to the raw features
    inits[fc_w].CopyFrom(numpy_helper.from_array(fc.astype(np.float32), fc_w))
    inits[fc_b].CopyFrom(numpy_helper.from_array((bias - fc @ mean).astype(np.float32), fc_b))


def save(model: onnx.ModelProto, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def demo_classifier(head_training: tuple[list[dict[str, np.ndarray]], np.ndarray] | None = None) -> onnx.ModelProto:
    """The `make demo` model: ResNet layout at a size that builds in seconds on two cores (128x128 input)."""
    return resnet(layout=(1, 1, 1, 1), width=32, image_size=128, seed=0, head_training=head_training)


HEAD_TRAINING_COUNT = 96  # photo_dataset() images the demo and benchmarks train the head on, then set aside


def photo_dataset(size: int = 224, per_photo: int = 48, seed: int = 0, photos: list[np.ndarray] | None = None,
                  mean_std: tuple[tuple[float, ...], tuple[float, ...]] | None = None,
                  ) -> tuple[list[dict[str, np.ndarray]], np.ndarray]:
    """Labelled images: random crops (45-100% of the side, aspect 0.8-1.25, half of them mirrored)
    of `photos` (RGB uint8; by default the distinct photos shipped with scikit-image), preprocessed
    to `image` feed dicts (batch 1), normalized by `mean_std` (of pixels in 0-1; default ImageNet's).
    The label is the photo a crop came from. Shuffled, deterministic for a seed."""
    from PIL import Image

    from accel_opt.preprocess.images import preprocess_image
    from accel_opt.recipe.deployed import Preprocessing

    rng = np.random.default_rng(seed)
    pre = Preprocessing(resize=round(size * 256 / 224), crop=size,
                        **({"mean": mean_std[0], "std": mean_std[1]} if mean_std else {}))
    samples, labels = [], []
    for label, photo in enumerate(_skimage_photos() if photos is None else photos):
        base = Image.fromarray(photo)
        width, height = base.size
        for _ in range(per_photo):
            side, aspect = rng.uniform(0.45, 1.0), rng.uniform(0.8, 1.25)
            crop_w = min(width, int(width * side * np.sqrt(aspect)))
            crop_h = min(height, int(height * side / np.sqrt(aspect)))
            left, top = int(rng.integers(0, width - crop_w + 1)), int(rng.integers(0, height - crop_h + 1))
            img = base.crop((left, top, left + crop_w, top + crop_h))
            if rng.random() < 0.5:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
            samples.append({"image": preprocess_image(img, pre)})
            labels.append(label)
    order = rng.permutation(len(samples))
    return [samples[i] for i in order], np.asarray(labels)[order]


def photo_samples(size: int = 224, count: int | None = None) -> list[dict[str, np.ndarray]]:
    """The images of `photo_dataset` without labels (the first `count`)."""
    return photo_dataset(size)[0][:count]


def _skimage_photos() -> list[np.ndarray]:
    from skimage import data

    photos = []
    for name in ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry",
                 "motorcycle_left", "motorcycle_right", "retina", "colorwheel", "logo"):
        try:
            image = getattr(data, name)()
        except Exception:  # some need a download, which fails offline
            continue
        if isinstance(image, tuple):  # stereo pairs return (left, right, disparity)
            image = image[0]
        if image.ndim == 2:
            image = np.stack([image] * 3, axis=-1)
        photos.append(np.ascontiguousarray(image[..., :3]).astype(np.uint8))
    return photos


def saturating_conv(channels: int = 64, seed: int = 0) -> onnx.ModelProto:
    """A model whose int8 u8 x s8 pair sums overflow int16: non-negative inputs near the top of their range into a
    conv whose weights share one sign per output channel at near-full magnitude, so 2 x 255 x 127 > 32767 in the
    VPMADDUBSW kernels of AVX2 / AVX-512-without-VNNI CPUs. Input x [batch, channels, 16, 16] -> y [batch, 10]."""
    rng = np.random.default_rng(seed)
    sign = np.where(rng.random((32, 1, 1, 1)) < 0.5, -1, 1)
    w = (sign * (0.5 + 0.5 * rng.random((32, channels, 1, 1))) * np.ones((1, 1, 3, 3))).astype(np.float32)
    head = (rng.standard_normal((10, 32)) * 0.1).astype(np.float32)
    nodes = [helper.make_node("Relu", ["x"], ["xr"], name="relu0"),
             helper.make_node("Conv", ["xr", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu1"),
             helper.make_node("GlobalAveragePool", ["r"], ["p"], name="gap"),
             helper.make_node("Flatten", ["p"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "head"], ["y"], name="fc", transB=1)]
    graph = helper.make_graph(nodes, "saturating_conv",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", channels, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 10])],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(head, "head")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def saturating_inputs(count: int, channels: int = 64, seed: int = 1) -> list[dict[str, np.ndarray]]:
    """Inputs for saturating_conv: values in [0.8, 1] (uint8 codes near 255), a tenth of the channels off."""
    rng = np.random.default_rng(seed)
    return [{"x": ((0.8 + 0.2 * rng.random((1, channels, 16, 16))) * (rng.random((1, channels, 1, 1)) < 0.9))
             .astype(np.float32)} for _ in range(count)]


def text_encoder(vocab_size: int, width: int = 32, seed: int = 0) -> onnx.ModelProto:
    """A sentence encoder with BERT's interface: input_ids, attention_mask [batch, tokens] int64 -> embedding
    [batch, width]. Token embeddings, one masked self-attention layer (padding gets -1e4 before the softmax, as BERT
    adds), a tanh projection, mean pooling over the mask: padding a text must not change its embedding."""
    rng = np.random.default_rng(seed)

    def weight(name: str, *shape: int, scale: float = 1.0) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * scale
                                        / np.sqrt(shape[0])).astype(np.float32), name)

    inits = [weight("E", vocab_size, width, scale=np.sqrt(vocab_size)), weight("Wq", width, width),
             weight("Wk", width, width), weight("Wv", width, width), weight("Wo", width, width),
             numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             numpy_helper.from_array(np.array(-1e4, np.float32), "neg"),
             numpy_helper.from_array(np.array(1.0 / np.sqrt(width), np.float32), "scale"),
             numpy_helper.from_array(np.array([1], np.int64), "axis1"),
             numpy_helper.from_array(np.array([2], np.int64), "axis2")]
    node = helper.make_node
    nodes = [
        node("Gather", ["E", "input_ids"], ["x"]),
        node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),  # [b, t]
        node("MatMul", ["x", "Wq"], ["q"]), node("MatMul", ["x", "Wk"], ["k"]), node("MatMul", ["x", "Wv"], ["v"]),
        node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        node("MatMul", ["q", "kt"], ["s0"]), node("Mul", ["s0", "scale"], ["s1"]),
        node("Sub", ["one", "m"], ["pad"]), node("Mul", ["pad", "neg"], ["bias0"]),
        node("Unsqueeze", ["bias0", "axis1"], ["bias"]),  # [b, 1, t]: keys that are padding get -1e4
        node("Add", ["s1", "bias"], ["s2"]), node("Softmax", ["s2"], ["a"], axis=-1),
        node("MatMul", ["a", "v"], ["h0"]), node("MatMul", ["h0", "Wo"], ["h1"]), node("Add", ["h1", "x"], ["h2"]),
        node("Tanh", ["h2"], ["h"]),
        node("Unsqueeze", ["m", "axis2"], ["m3"]),  # [b, t, 1]
        node("Mul", ["h", "m3"], ["hm"]), node("ReduceSum", ["hm", "axis1"], ["total"], keepdims=0),
        node("ReduceSum", ["m3", "axis1"], ["count"], keepdims=0),
        node("Div", ["total", "count"], ["embedding"]),
    ]
    tokens = ["batch", "tokens"]
    graph = helper.make_graph(nodes, "text_encoder",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, tokens),
                               helper.make_tensor_value_info("attention_mask", TensorProto.INT64, tokens)],
                              [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="accel-opt.zoo")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def word_tokenizer(texts: list[str], path: str | Path, vocab_size: int = 300) -> Path:
    """A BERT-style WordPiece tokenizer trained on `texts` ([CLS] text [SEP], lower-cased), saved as tokenizer.json."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece
    from tokenizers.trainers import WordPieceTrainer

    tokenizer = Tokenizer(WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.train_from_iterator(texts, WordPieceTrainer(vocab_size=vocab_size,
                                                          special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"]))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", tokenizer.token_to_id("[CLS]")),
                                                 ("[SEP]", tokenizer.token_to_id("[SEP]"))])
    tokenizer.enable_padding(pad_id=tokenizer.token_to_id("[PAD]"), pad_token="[PAD]")
    tokenizer.save(str(path))
    return Path(path)
