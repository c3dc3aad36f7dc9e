"""What the codec benchmarks (scripts/bench/codec.py, codec_tf.py) share: sizes, ratios, the table."""

from __future__ import annotations


def parse_size(text: str) -> int:
    """ "16M" -> 16 * 2**20, "512K" -> 512 * 2**10, "1000" -> 1000."""
    text = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20}.get(text[-1], 1)
    return int(float(text.rstrip("KM")) * scale)


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
    """Print the report and write it to ``out`` if given."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text)
