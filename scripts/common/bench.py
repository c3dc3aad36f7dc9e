"""What the benchmarks share: sizes, ratios and the table of the codec benchmark (scripts/bench/codec.py);
ResNet-50's parameter shapes (step.py)."""

from __future__ import annotations

from pathlib import Path


def parse_size(text: str) -> int:
    """ "16M" -> 16 * 2**20, "512K" -> 512 * 2**10, "1G" -> 2**30, "1000" -> 1000."""
    text = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1)
    return int(float(text.rstrip("KMG")) * scale)


def ratio_rows(size_text: str, medians: dict) -> list[tuple]:
    """(size, compressor, seconds, vs fp16, vs fp32) per compressor timed at one size."""
    return [
        (size_text, name, seconds, seconds / medians["fp16"], seconds / medians["none (fp32)"])
        for name, seconds in medians.items()
    ]


def timing_table(rows: list[tuple]) -> list[str]:
    """Markdown lines of :func:`ratio_rows` output."""
    return ["| elements | compressor | ms | vs fp16 | vs fp32 |", "|---|---|---|---|---|"] + [
        f"| {s} | {name} | {1e3 * t:.1f} | {r16:.2f} | {r32:.2f} |" for s, name, t, r16, r32 in rows
    ]


def write_report(lines: list[str], out: str | None) -> None:
    """Print the report and write it to ``out`` if given (its folder made if missing)."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w") as f:
            f.write(text)


BLOCKS = (3, 4, 6, 3)  # bottlenecks per stage of ResNet-50
WIDTHS = (64, 128, 256, 512)
EXPANSION = 4


def _conv_bn(shapes: list, conv: str, bn: str, out: int, inp: int, k: int) -> None:
    """A convolution's weight (out, in, k, k) and its batch norm's weight and bias, appended."""
    shapes.append((f"{conv}.weight", (out, inp, k, k)))
    shapes.append((f"{bn}.weight", (out,)))
    shapes.append((f"{bn}.bias", (out,)))


def resnet50_shapes(width: float = 1.0, classes: int = 1000) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of torchvision's resnet50 parameters, in ``named_parameters()`` order."""
    c = lambda ch: max(1, int(round(ch * width)))  # noqa: E731
    shapes: list[tuple[str, tuple[int, ...]]] = []
    stem = c(64)
    _conv_bn(shapes, "conv1", "bn1", stem, 3, 7)
    inplanes = stem
    for stage, (blocks, w) in enumerate(zip(BLOCKS, WIDTHS), start=1):
        w = c(w)
        out = w * EXPANSION
        for b in range(blocks):
            p = f"layer{stage}.{b}"
            _conv_bn(shapes, f"{p}.conv1", f"{p}.bn1", w, inplanes, 1)
            _conv_bn(shapes, f"{p}.conv2", f"{p}.bn2", w, w, 3)
            _conv_bn(shapes, f"{p}.conv3", f"{p}.bn3", out, w, 1)
            if b == 0:
                _conv_bn(shapes, f"{p}.downsample.0", f"{p}.downsample.1", out, inplanes, 1)
            inplanes = out
    shapes.append(("fc.weight", (classes, inplanes)))
    shapes.append(("fc.bias", (classes,)))
    return shapes


def numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
