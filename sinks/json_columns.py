"""JSON text over Arrow columns: what the writers of the events' JSON (the cache, the search
index) parse and pack in bulk, a column at a time, instead of a value at a time.

Every function gives the bytes orjson gives for each value alone (the stores keep what the
row-by-row writers kept); tests/test_sink_units.py compares them.
"""

from __future__ import annotations

import orjson
import pyarrow as pa
import pyarrow.compute as pc


def written_by_orjson(texts: list[str]) -> bool:
    """Whether every text is JSON exactly as orjson writes its value: one parse and one write of
    them all as an array (a text that is not JSON raises, as it would alone)."""
    joined = "[" + ",".join(texts) + "]"
    return orjson.dumps(orjson.loads(joined)) == joined.encode()


def compact_json(texts: pa.ChunkedArray | pa.Array) -> pa.ChunkedArray | pa.Array:
    """JSON texts (nulls stay null) as orjson writes them, as binary: the texts as they came
    when they are so already, found in one parse of them all, or else each written again.
    (Spark hands over the rows' JSON as its own parser wrote it again, which spells some
    numbers and escapes otherwise: 1.0E300, \\uD83D\\uDE00.)"""
    if written_by_orjson(texts.drop_null().to_pylist()):
        return texts.cast(pa.binary())
    loads, dumps = orjson.loads, orjson.dumps
    return pa.array([None if text is None else dumps(loads(text)) for text in texts.to_pylist()], pa.binary())


def json_strings(texts: pa.ChunkedArray | pa.Array) -> pa.ChunkedArray | pa.Array:
    """Each text as a JSON string (`orjson.dumps(text)`), as binary, for texts orjson wrote (key
    JSON: no raw control character, which orjson escapes): only `\\` and `"` need escaping."""
    escaped = pc.replace_substring(pc.replace_substring(texts.cast(pa.binary()), b"\\", b"\\\\"), b'"', b'\\"')
    return pc.binary_join_element_wise(b'"', escaped, b'"', b"")


def concatenated(values: pa.ChunkedArray | pa.Array) -> bytes:
    """The values of a string or binary column one after the other (nulls: nothing), read from
    its buffers (a slice shares its array's: its values are the bytes its offsets span)."""
    chunks = values.chunks if isinstance(values, pa.ChunkedArray) else [values]
    out = []
    for chunk in chunks:
        _, offsets, data = chunk.buffers()
        if data is None or not len(chunk):
            continue
        ends = pa.Array.from_buffers(pa.int32(), len(chunk) + 1, [None, offsets], offset=chunk.offset)
        start, end = ends[0].as_py(), ends[-1].as_py()
        out.append(data.slice(start, end - start).to_pybytes())
    return b"".join(out)
