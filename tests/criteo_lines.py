"""Criteo-format lines and files the reader tests build: LINE, a good line, and variants of it."""

LINE = "1\t" + "\t".join(["3", ""] + ["0"] * 11) + "\t" + "\t".join(["0000000a", ""] + ["ff"] * 24) + "\n"


def line(label="1", counts=("3",), values=("0000000a",)) -> str:
    """LINE with its first fields replaced."""
    fields = LINE.rstrip("\n").split("\t")
    fields[0] = label
    fields[1:1 + len(counts)] = counts
    fields[14:14 + len(values)] = values
    return "\t".join(fields) + "\n"


def bad_file(tmp_path, bad: str | bytes, before: int = 4):
    path = tmp_path / "part-00007.tsv"
    path.write_bytes(LINE.encode() * before + (bad if isinstance(bad, bytes) else bad.encode()) + LINE.encode())
    return path
