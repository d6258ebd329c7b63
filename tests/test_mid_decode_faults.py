"""Expert-file faults that happen while the engine serves, in every path that reads experts.

The fault is injected from inside the store's read path after a few reads, so it lands
mid-decode deterministically (staged prefetches and batched unions included), never
between two generate calls only. Every fault is a change of the open file, which the store's
FileGuard (engine/store.py) sees after the read that follows it, whatever --verify-crc
says: one CheckpointError naming the file, and nothing recorded.
"""

from __future__ import annotations

import os
import shutil
import stat
import threading
import time
from pathlib import Path

import httpx
import pytest
from bad_inputs import copy_model
from fidelity_sets import fidelity_set
from live_server import LiveServer
from perturbed_heads import perturbed_heads

from edge0_eval.cli import main
from edge0_eval.engine.engine import Engine
from edge0_eval.engine.lora import apply_lora, lora_modules, save_adapter
from edge0_eval.engine.options import EngineOptions
from edge0_eval.engine.store import SETTLE_NS, ExpertStore, FileGuard
from edge0_eval.errors import CheckpointError
from edge0_eval.evaluation.fidelity import scoring as fid
from edge0_eval.evaluation.fidelity import sets as fs
from edge0_eval.formats.layout import EXPERTS_NAME, ExpertIndex

CHANGED = "changed while the engine was reading it"
PROMPTS = [[5, 6, 7, 8, 9], [9, 10, 11], [3, 1, 4, 1, 5, 9]]


def _truncate(path):
    os.truncate(path, 0)


def _overwrite(path):
    size = path.stat().st_size
    with open(path, "r+b") as f:  # in place: same inode, same size
        f.write(b"\x5a" * size)


def _zero(path):
    """The fault as first reported: zeros over the whole file in place (same inode), on disk."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.write(bytes(size))
        f.flush()
        os.fsync(f.fileno())


def _quiet(path):
    """Long since written: a bundle's checksum verdict is kept (store.SETTLE_NS)."""
    os.utime(path, ns=(time.time_ns() - 10 * SETTLE_NS,) * 2)


def _inject_after(store, n_reads: int, fault, path) -> threading.Event:
    """Run `fault(path)` once, just before the store's n-th read from now; the event is set
    as it starts (reads already under way may see the change before it has finished)."""
    done, lock, count = threading.Event(), threading.Lock(), [0]
    original = store.read_into

    def read(layer, expert, pieces):
        with lock:
            count[0] += 1
            if count[0] == n_reads and not done.is_set():
                done.set()
                fault(path)
        return original(layer, expert, pieces)

    store.read_into = read
    return done


@pytest.fixture(scope="module")
def heads(edge0_qwen, tmp_path_factory):
    path, _ = perturbed_heads(edge0_qwen, tmp_path_factory.mktemp("heads"))
    return path


@pytest.mark.parametrize(
    "fault", [_truncate, _overwrite], ids=["truncated", "overwritten"]
)
@pytest.mark.parametrize(
    "mode, batch",
    [("reactive", 1), ("prerouted", 1), ("reactive", 3), ("prerouted", 3)],
)
def test_fault_mid_decode_stops_with_clear_error(
    edge0_qwen, heads, tmp_path, mode, batch, fault
):
    model = copy_model(edge0_qwen, tmp_path / "m")
    options = dict(mode=mode, slots_per_layer=4)
    if mode == "prerouted":
        options["prerouter_path"] = str(heads)
    _quiet(model / EXPERTS_NAME)
    engine = Engine.load(model, EngineOptions(**options))
    try:
        # A clean decode first: its bundles are verified (and, settled, trusted) before the fault.
        engine.generate(PROMPTS[0], max_tokens=4, stop_token_ids=set())
        injected = _inject_after(engine.store, 6, fault, model / EXPERTS_NAME)
        with pytest.raises(CheckpointError) as err:
            if batch == 1:
                engine.generate(PROMPTS[1], max_tokens=64, stop_token_ids=set())
            else:
                engine.generate_batch(
                    PROMPTS[:batch], max_tokens=64, stop_token_ids=set()
                )
        assert injected.is_set()
        assert str(model / EXPERTS_NAME) in str(err.value)
        assert CHANGED in str(err.value)
        assert ("size" if fault is _truncate else "written in place") in str(err.value)
    finally:
        engine.close()


def test_verdicts_kept_only_once_the_file_is_settled(edge0_qwen, tmp_path):
    """A file modified moments before it was opened may still be mid-write: each read of it
    is checksummed; one long quiet keeps a bundle's verdict after its first read."""
    model = copy_model(edge0_qwen, tmp_path / "m")
    path = model / EXPERTS_NAME
    for touched, checksums in ((os.utime, 3), (_quiet, 1)):
        touched(path)
        store = ExpertStore(model)
        try:
            layer = store.index.moe_layers[0]
            for _ in range(3):
                store.read(layer, 0)
            assert (store.stats.crc_bundles, store.stats.reads) == (checksums, 3)
        finally:
            store.close()


# -- zeroed in place once every bundle has been read (and, with --verify-crc, trusted) ----------


def _all_bundles(store) -> list[tuple[int, int]]:
    return [
        (l, e) for l in store.index.moe_layers for e in range(store.index.num_experts)
    ]


def _options(mode: str, heads, verify_crc: bool) -> EngineOptions:
    extra = {"prerouter_path": str(heads)} if mode == "prerouted" else {}
    return EngineOptions(
        mode=mode, slots_per_layer=4, verify_crc=verify_crc, no_lora=True, **extra
    )


def _every_bundle_read(store) -> None:
    """Every bundle read once: with --verify-crc each is checked and, settled, trusted."""
    store.read_many(_all_bundles(store))
    assert store.stats.crc_bundles == (
        len(_all_bundles(store)) if store.verify_crc else 0
    )


def _names_the_change(message: str, path) -> None:
    assert str(path) in message and CHANGED in message, message
    assert "written in place" in message and "records nothing" in message


CRC = pytest.mark.parametrize("verify_crc", [True, False], ids=["crc", "no-crc"])


@CRC
@pytest.mark.parametrize("mode", ["reactive", "prerouted"])
def test_zeroed_in_place_after_every_bundle_was_read(
    edge0_qwen, heads, tmp_path, mode, verify_crc
):
    model = copy_model(edge0_qwen, tmp_path / "m")
    path = model / EXPERTS_NAME
    _quiet(path)
    engine = Engine.load(model, _options(mode, heads, verify_crc))
    try:
        _every_bundle_read(engine.store)
        injected = _inject_after(engine.store, 6, _zero, path)
        with pytest.raises(CheckpointError) as err:
            engine.generate(PROMPTS[1], max_tokens=200, stop_token_ids=set())
        assert injected.is_set()
        _names_the_change(str(err.value), path)
    finally:
        engine.close()


@pytest.mark.parametrize("crc_flag", ["--verify-crc", "--no-verify-crc"])
def test_generate_zeroed_in_place_stops_and_writes_nothing(
    edge0_qwen, heads, tmp_path, monkeypatch, capsys, crc_flag
):
    """The command first reported: `generate --mode prerouted --slots-per-layer 4 --no-lora`, the
    file zeroed in place (fsync) once every bundle has been read: exit 2, one line naming the
    file, no --json."""
    model = copy_model(edge0_qwen, tmp_path / "m")
    path = model / EXPERTS_NAME
    _quiet(path)
    seen, injected, lock = set(), threading.Event(), threading.Lock()
    original = ExpertStore.read_into

    def read(store, layer, expert, pieces):
        with lock:
            if len(seen) == len(_all_bundles(store)) and not injected.is_set():
                injected.set()
                _zero(path)
            seen.add((layer, expert))
        return original(store, layer, expert, pieces)

    monkeypatch.setattr(ExpertStore, "read_into", read)
    out = tmp_path / "gen.json"
    code = main(
        [
            "generate",
            str(model),
            "--prompt",
            "hello",
            "--mode",
            "prerouted",
            "--prerouter",
            str(heads),
            "--slots-per-layer",
            "4",
            "--no-lora",
            "--max-tokens",
            "1500",
            crc_flag,
            "--json",
            str(out),
        ]
    )
    err = capsys.readouterr().err
    assert injected.is_set(), "the decode ended before it had read every bundle"
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    _names_the_change(err, path)
    assert not out.exists()


@CRC
def test_served_request_zeroed_in_place_is_an_error_naming_the_file(
    edge0_qwen, tmp_path, verify_crc
):
    model = copy_model(edge0_qwen, tmp_path / "m")
    path = model / EXPERTS_NAME
    _quiet(path)
    server = LiveServer(model, _options("reactive", None, verify_crc), name="tiny")
    try:
        store = server.worker.engine.store  # the worker is idle: no request yet
        _every_bundle_read(store)
        injected = _inject_after(store, 6, _zero, path)
        r = httpx.post(
            f"{server.base}/chat/completions",
            timeout=60,
            json=dict(
                model="tiny",
                messages=[{"role": "user", "content": "Write a haiku about disks."}],
                max_tokens=64,
            ),
        )
        assert injected.is_set()
        assert r.status_code == 500, r.text
        _names_the_change(r.json()["error"]["message"], path)
    finally:
        server.close()


def _fidelity_set(tmp_path, vocab: int) -> dict:
    """A valid two-item set (read back through read_set) over ids the model has."""
    tokens = [(7 * i + 5) % vocab for i in range(24)]
    items = [
        {
            "id": f"t/{n}",
            "source": "text",
            "prompt": "p",
            "prompt_ids": [3 + n, 4, 5, 6],
            "tokens": tokens,
            "topk_ids": [[t, (t + 1) % vocab] for t in tokens],
            "topk_logprobs": [[-0.1, -2.5]] * len(tokens),
            "rest": [0.05] * len(tokens),
            "end": "length",
        }
        for n in range(2)
    ]
    fset = fidelity_set(items, max_new=len(tokens), min_new=1)
    return fs.read_set(fs.write_set(fset, tmp_path / "set.json"))


@CRC
def test_fidelity_scoring_zeroed_in_place_stops(
    edge0_qwen, heads, tmp_path, verify_crc
):
    model = copy_model(edge0_qwen, tmp_path / "m")
    path = model / EXPERTS_NAME
    _quiet(path)
    engine = Engine.load(model, _options("prerouted", heads, verify_crc))
    try:
        fset = _fidelity_set(tmp_path, engine.tokenizer.vocab_size)
        _every_bundle_read(engine.store)
        injected = _inject_after(engine.store, 6, _zero, path)
        with pytest.raises(CheckpointError) as err:
            fid.score_model(engine, fset)
        assert injected.is_set()
        _names_the_change(str(err.value), path)
    finally:
        engine.close()


# -- what the guard calls a change ------------------------------------------------------------


def _same_times(path):
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_guard_sees_every_change_of_the_open_file(edge0_qwen, tmp_path):
    """Beyond writes in place: the file replaced at its path (the folder now holds another
    model), a writer setting mtime back (only ctime moves), truncation."""
    model = copy_model(edge0_qwen, tmp_path / "m")
    path = model / EXPERTS_NAME
    bundle = (ExpertIndex.load(model).moe_layers[0], 0)

    def replace(p):
        (model / "new.bin").write_bytes(p.read_bytes())  # the same bytes, another file
        os.replace(model / "new.bin", p)

    for change, what in (
        (replace, "deleted or replaced"),
        (_same_times, "ctime moved"),
        (lambda p: os.chmod(p, stat.S_IRUSR | stat.S_IWUSR), "permissions"),
        (lambda p: os.truncate(p, p.stat().st_size - 1), "size"),
    ):
        _quiet(path)
        store = ExpertStore(model, verify_crc=False)
        try:
            store.read(*bundle)
            time.sleep(0.01)  # past the coarse clock's tick
            change(path)
            with pytest.raises(CheckpointError, match=what):
                store.read(*bundle)
        finally:
            store.close()


def test_guard_names_the_file_and_the_fix(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 8)
    fd = os.open(path, os.O_RDONLY)
    try:
        guard = FileGuard(fd, path, "do this")
        guard.check()
        with open(path, "ab") as f:
            f.write(b"y")
        with pytest.raises(CheckpointError) as err:
            guard.check()
        assert str(path) in str(err.value) and "size 8 -> 9" in str(err.value)
        assert str(err.value).endswith("do this")
    finally:
        os.close(fd)


def test_adapters_and_heads_are_read_whole_at_load(edge0_qwen, heads, tmp_path):
    """Why only experts.bin is guarded: the LoRA adapter and the prerouter heads are read
    and evaluated when the engine loads, so zeroing them in place afterwards changes nothing
    a running engine computes (the LoRA does change the output: the control)."""
    model = copy_model(edge0_qwen, tmp_path / "m")
    engine = Engine.load(model, EngineOptions(mode="reactive", no_lora=True))
    apply_lora(engine.model, r=4, init="random", seed=3, family=engine.family.name)
    for module in lora_modules(engine.model).values():
        module.lora_B = module.lora_B * 0.5
    save_adapter(engine.model, model / "lora.safetensors")
    engine.close()
    heads = Path(shutil.copy(heads, model / "prerouter.safetensors"))
    options = dict(mode="prerouted", slots_per_layer=4, prerouter_path=str(heads))

    def decode(no_lora=False, zero_after_load=()):
        engine = Engine.load(model, EngineOptions(no_lora=no_lora, **options))
        try:
            for path in zero_after_load:
                _zero(path)
            return engine.generate(PROMPTS[2], max_tokens=24, stop_token_ids=set())
        finally:
            engine.close()

    served = decode().tokens
    assert decode(no_lora=True).tokens != served
    assert decode(zero_after_load=[model / "lora.safetensors", heads]).tokens == served
