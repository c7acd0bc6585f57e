"""Fuzz target for the C accelerator (cdc/_speedups.c), run under AddressSanitizer by run.sh.

Memory errors in the C parsers would corrupt events silently or crash the daemon, and the
Python twins cannot show them: ASan can. Each input also checks the C side against its
twin (differential fuzzing): whatever C accepts, it must render exactly as the twin does;
whatever it declines (None), the twin decides. The first input byte picks the target:

  0 parse_tuple      (through Decoder.decode of an Insert)
  1 parse_copy_line  (through snapshot.copy_text.parse_line)
  2 render_change    (through ChangeRenderer.render_xlogdata, against decode + records)
  3 RowEncoder.encode (through TableEvents.encode, tab-separated text values)
  4 partition_for

With atheris (coverage-guided libFuzzer) when it is installed; otherwise a plain loop of
random and mutated inputs from the seeds below. Usage: see fuzz/README.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import re
import struct
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _load_build(path: str | None) -> None:
    """Import the sanitized build as cdc._speedups, before cdc.accel looks for one."""
    if not path:
        return
    spec = importlib.util.spec_from_file_location("cdc._speedups", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["cdc._speedups"] = module
    spec.loader.exec_module(module)


_load_build(os.environ.get("CDC_FUZZ_EXTENSION"))

from cdc import accel  # noqa: E402
from cdc.events.changes import ChangeRenderer  # noqa: E402
from cdc.events.records import Column, TableEvents, Txn  # noqa: E402
from cdc.events.types import converter  # noqa: E402
from cdc.kafka.partitioner import partition_for  # noqa: E402
from cdc.source.pgoutput import DecodeError, Decoder  # noqa: E402
from cdc.source.pgtypes import BUILTIN_TYPES  # noqa: E402
from snapshot import copy_text  # noqa: E402

if accel.speedups is None:
    sys.exit("cdc._speedups is not built: run fuzz/run.sh, which builds it with AddressSanitizer")
C = accel.speedups

OID = 16400
_TYPES = {t.name: t for t in BUILTIN_TYPES.values()}
# every kind the C encoder writes itself (int, string, bool, timestamptz) and one it calls back
_COLUMNS = [("id", "int4"), ("note", "text"), ("flag", "bool"), ("at", "timestamptz"), ("n", "numeric")]
_STAMPS = re.compile(rb'"ts_ms":\d+,"ts_us":\d+,"ts_ns":\d+}$')
TXN = Txn(commit_lsn=0x1_0000_0000, commit_ts_us=1_700_000_000_123_456, xid=812)


def _events() -> TableEvents:
    columns = [Column(name, converter(_TYPES[t], -1), "__debezium_unavailable_value", {}) for name, t in _COLUMNS]
    return TableEvents("p", "db", "public", "t", "p.public.t", columns, [0])


def _renderer() -> ChangeRenderer:
    renderer = ChangeRenderer(None, "p", "db", ["public.t"], False)  # type: ignore[arg-type]
    events = renderer.tables[OID] = _events()
    if events.c_encoder is not None and renderer.render_xlogdata is not None:
        renderer.c_encoders[OID] = events.c_encoder
    return renderer


with accel.selected(True):
    FAST_EVENTS, FAST_RENDERER = _events(), _renderer()
with accel.selected(False):
    SLOW_EVENTS, SLOW_RENDERER = _events(), _renderer()
assert FAST_RENDERER.render_xlogdata is not None


def _outcome(call, *, c: bool) -> tuple[str, object]:
    """What `call()` returns on one side of the switch, or the error it raises."""
    with accel.selected(c):
        try:
            return "ok", call()
        except (DecodeError, ValueError, KeyError, TypeError, RuntimeError) as exc:
            return type(exc).__name__, str(exc)


def _same_on_both(call) -> None:
    fast, slow = _outcome(call, c=True), _outcome(call, c=False)
    assert fast == slow, (fast, slow)


def _unstamped(records) -> list:
    return [(r.topic, r.key, None if r.value is None else _STAMPS.sub(b"", r.value)) for r in records]


def one_input(data: bytes) -> None:
    if not data:
        return
    target, body = data[0] % 5, data[1:]
    if target == 0:
        insert = b"I" + struct.pack(">I", OID) + b"N" + body
        _same_on_both(lambda: Decoder().decode(insert))
        C.parse_tuple(body, 0, None)  # the raw entry point, any offset
        if body:
            C.parse_tuple(body, body[0] % (len(body) + 1), None)
    elif target == 1:
        _same_on_both(lambda: copy_text.parse_line(body))
    elif target == 2:
        message = b"w" + struct.pack(">QQq", 0x1_0000_0010, 0x1_0000_0040, 0) + body
        fast = _outcome(lambda: FAST_RENDERER.render_xlogdata(message, TXN), c=True)  # type: ignore[misc]
        if fast == ("ok", None):
            return  # declined: the Python path alone decides
        # accepted in C (or a converter raised there): the Python path must agree exactly
        slow = _outcome(lambda: SLOW_RENDERER.records(Decoder().decode(body), TXN, 0x1_0000_0010), c=False)
        if fast[0] == slow[0] == "ok":
            assert _unstamped(fast[1]) == _unstamped(slow[1]), (fast, slow)
        else:  # the same error type; the wording of e.g. a wrong row width may differ
            assert fast[0] == slow[0], (fast, slow)
    elif target == 3:
        try:
            text = body.decode()
        except UnicodeDecodeError:
            return
        values: list[str | None] = [None if v == "\\N" else v for v in text.split("\t")]
        if len(values) != len(_COLUMNS):
            return
        fast_out = _outcome(lambda: FAST_EVENTS.encode(values), c=True)
        slow_out = _outcome(lambda: SLOW_EVENTS.encode(values), c=False)
        assert fast_out[0] == slow_out[0], (values, fast_out, slow_out)
        assert fast_out[0] != "ok" or fast_out == slow_out, (values, fast_out, slow_out)
    else:
        partitions = 1 + (body[0] if body else 0)
        assert C.partition_for(body, partitions) == partition_for(body, partitions)


def seeds() -> list[bytes]:
    """Valid inputs for every target, so mutations start deep inside the parsers."""
    def tuple_bytes(values: list[str | None]) -> bytes:
        out = struct.pack(">H", len(values))
        for v in values:
            out += b"n" if v is None else b"t" + struct.pack(">I", len(v.encode())) + v.encode()
        return out

    row = ["1", 'a "q"\n', "t", "2024-01-02 03:04:05.123456+00", "1.50"]
    head = struct.pack(">I", OID)
    return [
        b"\x00" + tuple_bytes(row),
        b"\x00" + tuple_bytes(["7", None, "f", None, "NaN"]) + b"u",
        b"\x01" + "1\tab\\tc\t\\N\té𝄞\n".encode(),
        b"\x02I" + head + b"N" + tuple_bytes(row),
        b"\x02U" + head + b"O" + tuple_bytes(row) + b"N" + tuple_bytes(["2", "x", "f", None, "0"]),
        b"\x02D" + head + b"K" + tuple_bytes(["1", None, None, None, None]),
        b"\x03" + "\t".join(row).encode(),
        b"\x03" + b"-2147483648\t\\N\tf\t2024-01-02 03:04:05+05:30\tInfinity",
        b"\x04\x07some key",
    ]


def mutate(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        at = rng.randint(0, len(out))
        action = rng.randrange(5)
        if action == 0 and at < len(out):
            out[at] ^= 1 << rng.randrange(8)
        elif action == 1:
            out[at:at] = rng.randbytes(rng.randint(1, 8))
        elif action == 2:
            del out[at : at + rng.randint(1, 8)]
        elif action == 3 and at < len(out):
            out[at] = rng.choice([0, 0x7F, 0x80, 0xFF, ord("u"), ord("n"), ord("t"), ord("\\"), ord("\t")])
        else:
            del out[at:]
    return bytes(out)


def plain_loop(seconds: float, seed: int) -> int:
    """Random and mutated inputs for `seconds`, without coverage guidance."""
    rng = random.Random(seed)
    pool = seeds()
    end = time.monotonic() + seconds
    runs = 0
    while time.monotonic() < end:
        if rng.random() < 0.1:
            data = bytes([rng.randrange(5)]) + rng.randbytes(rng.randint(0, 64))
        else:
            data = mutate(rng, rng.choice(pool))
        try:
            one_input(data)
        except AssertionError:
            print(f"mismatch on input {data!r}", file=sys.stderr)
            raise
        if len(pool) < 2000 and rng.random() < 0.05:
            pool.append(data)
        runs += 1
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plain", type=float, metavar="SECONDS", help="run the plain loop instead of atheris")
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--write-seeds", metavar="DIR", help="write the seed corpus into DIR and exit")
    args, libfuzzer_args = parser.parse_known_args()
    if args.write_seeds:
        Path(args.write_seeds).mkdir(parents=True, exist_ok=True)
        for i, seed in enumerate(seeds()):
            Path(args.write_seeds, f"seed{i}").write_bytes(seed)
        return
    maps = Path("/proc/self/maps").read_text()
    sanitizer = next((word for word in ("libclang_rt.asan", "libasan") if word in maps), None)
    print(f"fuzzing {C.__file__} under {sanitizer or 'NO SANITIZER (run it through fuzz/run.sh)'}", flush=True)
    if args.plain is not None:
        runs = plain_loop(args.plain, args.seed)
        print(f"plain loop: {runs} inputs in {args.plain:.0f} s (seed {args.seed}), no finding")
        return
    import atheris

    atheris.Setup([sys.argv[0], *libfuzzer_args], one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
