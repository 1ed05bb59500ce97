"""mpext.integrations.checkpoint: atomic, checksummed checkpoint files.

A checkpoint of a real training state (FP16 model, mpext.optim.AdamW with FP32 masters,
mpext.GradScaler) round-trips bit for bit, and training continued from the loaded state is bit
for bit the training continued from the original. Truncation at every byte boundary, trailing
bytes and bit flips (every bit of the header, one bit in every payload byte) are detected, also
where torch.load alone would load a silently changed tensor. The write protocol (temporary file,
fsync, os.replace, directory fsync) is checked by recording the system calls; a write that fails
half-way leaves the previous checkpoint intact; latest_checkpoint skips temporary files and
corrupt files and orders by the step number in the name."""
import io
import os
import random
import struct

import pytest
import torch

import mpext
import mpext.integrations.checkpoint as ckpt
from mpext.integrations.checkpoint import CheckpointError

HEADER = ckpt.HEADER_SIZE


def make_training_state(steps=3, seed=0):
    """A tiny FP16 model trained a few steps with mpext AdamW (FP32 masters) and GradScaler."""
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model = model.to(torch.float16)
    opt = mpext.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = mpext.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    for _ in range(steps):
        train_step(model, opt, scaler, g)
    return model, opt, scaler, g


def train_step(model, opt, scaler, g):
    x = torch.randn(4, 6, generator=g).to(torch.float16)
    y = torch.randn(4, 2, generator=g).to(torch.float16)
    loss = (model(x).float() - y.float()).pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


def full_state(model, opt, scaler):
    return {"step": 3, "model": model.state_dict(), "optimizer": opt.state_dict(),
            "scaler": scaler.state_dict()}


def flat(obj, prefix=""):
    """Every leaf of a nested state as (path, value), in a fixed order."""
    if isinstance(obj, dict):
        out = []
        for k in obj:
            out += flat(obj[k], "%s/%s" % (prefix, k))
        return out
    if isinstance(obj, (list, tuple)):
        out = []
        for i, v in enumerate(obj):
            out += flat(v, "%s[%d]" % (prefix, i))
        return out
    return [(prefix, obj)]


def assert_same_state(a, b):
    fa, fb = flat(a), flat(b)
    assert [k for k, _ in fa] == [k for k, _ in fb]
    for (k, va), (_, vb) in zip(fa, fb):
        if isinstance(va, torch.Tensor):
            assert isinstance(vb, torch.Tensor), k
            assert va.dtype == vb.dtype and va.shape == vb.shape, k
            assert torch.equal(va.reshape(-1).view(torch.uint8),
                               vb.reshape(-1).view(torch.uint8)), k
        else:
            assert type(va) is type(vb) and va == vb, k


@pytest.fixture(scope="module")
def small_file(tmp_path_factory):
    """The bytes of a small checkpoint of a real training state."""
    model, opt, scaler, _ = make_training_state()
    path = tmp_path_factory.mktemp("ckpt") / "small.pt"
    ckpt.save_checkpoint(path, full_state(model, opt, scaler))
    return path.read_bytes()


# ---------------------------------------------------------------------------------------------
# Round trip.


def test_round_trip_is_bitwise_and_training_continues_identically(tmp_path):
    model, opt, scaler, g = make_training_state(steps=5)
    state = full_state(model, opt, scaler)
    path = tmp_path / "step_5.pt"
    ckpt.save_checkpoint(path, state)
    loaded = ckpt.load_checkpoint(path)
    assert_same_state(state, loaded)
    assert set(loaded["optimizer"]["state"][0]) == {"step", "exp_avg", "exp_avg_sq",
                                                    "master_param"}

    # Fresh objects restored from the file train on exactly as the originals do.
    model2, opt2, scaler2, _ = make_training_state(steps=0, seed=1)
    model2.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["optimizer"])
    scaler2.load_state_dict(loaded["scaler"])
    g2 = torch.Generator()
    g2.set_state(g.get_state())
    for _ in range(6):
        train_step(model, opt, scaler, g)
        train_step(model2, opt2, scaler2, g2)
    assert_same_state(full_state(model, opt, scaler), full_state(model2, opt2, scaler2))


def test_header_layout(small_file):
    magic, version, flags, length = struct.unpack_from("<8sIIQ", small_file)
    assert magic == b"MPEXTCKP" and version == ckpt.FORMAT_VERSION and flags == 0
    assert length == len(small_file) - HEADER
    import hashlib
    assert small_file[24:56] == hashlib.sha256(small_file[HEADER:]).digest()
    # The payload is plain torch.save output.
    assert isinstance(torch.load(io.BytesIO(small_file[HEADER:]), weights_only=True), dict)


def test_overwrite_replaces_content(tmp_path):
    path = tmp_path / "c.pt"
    ckpt.save_checkpoint(path, {"v": torch.tensor([1.0])})
    ckpt.save_checkpoint(str(path), {"v": torch.tensor([2.0]), "extra": 7})
    got = ckpt.load_checkpoint(path)
    assert got["extra"] == 7 and torch.equal(got["v"], torch.tensor([2.0]))
    assert os.listdir(tmp_path) == ["c.pt"]


def test_long_file_name(tmp_path):
    path = tmp_path / ("x" * 250 + ".pt")  # the temporary name must stay within 255 bytes
    ckpt.save_checkpoint(path, {"v": 1})
    assert ckpt.load_checkpoint(path) == {"v": 1}


def test_map_location(tmp_path):
    path = tmp_path / "c.pt"
    ckpt.save_checkpoint(path, {"v": torch.arange(3)})
    assert ckpt.load_checkpoint(path, map_location="meta")["v"].device.type == "meta"


def test_weights_only_by_default(tmp_path):
    path = tmp_path / "c.pt"
    ckpt.save_checkpoint(path, {"obj": random.Random(0)})  # any pickled object can be saved
    with pytest.raises(Exception, match="[Ww]eights only"):
        ckpt.load_checkpoint(path)
    assert isinstance(ckpt.load_checkpoint(path, weights_only=False)["obj"], random.Random)


# ---------------------------------------------------------------------------------------------
# Corruption is detected.


def write(tmp_path, data, name="c.pt"):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def verify_error(path):
    """The message of the CheckpointError verify_checkpoint raises, or "" if it passes (a
    plain try: pytest.raises costs milliseconds per call, and these loops make thousands)."""
    try:
        ckpt.verify_checkpoint(path)
    except CheckpointError as e:
        return str(e)
    return ""


def test_truncation_at_every_byte_is_detected(tmp_path, small_file):
    assert len(small_file) > 2000  # a real optimizer state, not a toy
    p = tmp_path / "t.pt"
    for n in range(len(small_file)):
        p.write_bytes(small_file[:n])
        err = verify_error(p)
        assert "truncated" in err and str(p) in err, n
    # ... and load_checkpoint refuses them too (a sample: it shares the check).
    for n in (0, 7, HEADER - 1, HEADER, HEADER + 1, len(small_file) // 2, len(small_file) - 1):
        p.write_bytes(small_file[:n])
        with pytest.raises(CheckpointError, match="truncated"):
            ckpt.load_checkpoint(p)
    p.write_bytes(small_file)
    ckpt.verify_checkpoint(p)  # the whole file is fine


def test_trailing_bytes_are_detected(tmp_path, small_file):
    for extra in (b"\0", b"x" * 100):
        with pytest.raises(CheckpointError, match="trailing bytes"):
            ckpt.load_checkpoint(write(tmp_path, small_file + extra))


def test_every_header_bit_flip_is_detected(tmp_path, small_file):
    p = tmp_path / "f.pt"
    for bit in range(HEADER * 8):
        data = bytearray(small_file)
        data[bit // 8] ^= 1 << (bit % 8)
        p.write_bytes(bytes(data))
        assert verify_error(p), bit


def test_a_bit_flip_in_every_payload_byte_is_detected(tmp_path, small_file):
    rng = random.Random(1)
    p = tmp_path / "f.pt"
    for pos in range(HEADER, len(small_file)):
        data = bytearray(small_file)
        data[pos] ^= 1 << rng.randrange(8)
        p.write_bytes(bytes(data))
        assert "SHA-256" in verify_error(p), pos


def test_checksum_catches_what_torch_load_would_accept(tmp_path):
    """A flipped bit inside tensor data unpickles fine with torch.load and silently changes a
    master weight; the checksum refuses it."""
    master = torch.full((64,), 1.0)
    ckpt.save_checkpoint(tmp_path / "m.pt", {"master": master})
    data = bytearray((tmp_path / "m.pt").read_bytes())
    raw = master.numpy().tobytes()
    at = bytes(data).index(raw)  # the tensor's storage is stored uncompressed
    data[at + 2] ^= 0x40  # one exponent bit of master[0]
    changed = torch.load(io.BytesIO(bytes(data[HEADER:])), weights_only=True)["master"]
    assert not torch.equal(changed, master)  # torch.load alone: accepted, wrong value
    with pytest.raises(CheckpointError, match="SHA-256"):
        ckpt.load_checkpoint(write(tmp_path, bytes(data)))


def test_not_an_mpext_checkpoint(tmp_path):
    torch.save({"a": torch.zeros(2)}, tmp_path / "plain.pt")
    with pytest.raises(CheckpointError, match="not an mpext checkpoint.*torch.load"):
        ckpt.load_checkpoint(tmp_path / "plain.pt")
    with pytest.raises(CheckpointError, match="truncated: 0 bytes"):
        ckpt.load_checkpoint(write(tmp_path, b""))
    with pytest.raises(FileNotFoundError):
        ckpt.load_checkpoint(tmp_path / "missing.pt")


def test_unsupported_version_is_named(tmp_path, small_file):
    data = bytearray(small_file)
    struct.pack_into("<I", data, 8, ckpt.FORMAT_VERSION + 1)
    with pytest.raises(CheckpointError, match="format version %d.*reads version %d"
                       % (ckpt.FORMAT_VERSION + 1, ckpt.FORMAT_VERSION)):
        ckpt.load_checkpoint(write(tmp_path, bytes(data)))


# ---------------------------------------------------------------------------------------------
# The write protocol.


def test_write_protocol_fsync_rename_fsync_dir(tmp_path, monkeypatch):
    """Data is fsync'ed in the temporary file before the rename, and the directory after it."""
    events = []
    real_fsync, real_replace, real_open = os.fsync, os.replace, os.open
    fd_names = {}

    def rec_open(path, flags, *a, **k):
        fd = real_open(path, flags, *a, **k)
        fd_names[fd] = os.fspath(path)
        return fd

    def rec_fsync(fd):
        name = fd_names.get(fd)
        if name is None:  # the temporary file, opened by open()
            name = os.readlink("/proc/self/fd/%d" % fd) if os.path.exists("/proc/self/fd") \
                else "file"
        events.append(("fsync", name))
        real_fsync(fd)

    def rec_replace(src, dst):
        events.append(("replace", os.fspath(src), os.fspath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", rec_fsync)
    monkeypatch.setattr(os, "replace", rec_replace)
    monkeypatch.setattr(os, "open", rec_open)
    target = tmp_path / "step_1.pt"
    ckpt.save_checkpoint(target, {"x": torch.ones(3)})
    monkeypatch.undo()
    assert [e[0] for e in events] == ["fsync", "replace", "fsync"]
    tmp = events[1][1]
    assert os.path.dirname(tmp) == str(tmp_path) and ckpt.is_temporary_file(tmp)
    assert events[1][2] == str(target)
    if os.path.exists("/proc/self/fd"):
        assert events[0][1] == tmp
    assert os.path.realpath(events[2][1]) == os.path.realpath(str(tmp_path))
    assert os.listdir(tmp_path) == ["step_1.pt"]


@pytest.mark.parametrize("fail_in", ["fsync", "replace"])
def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch, fail_in):
    target = tmp_path / "c.pt"
    ckpt.save_checkpoint(target, {"v": torch.tensor([1.0])})
    before = target.read_bytes()

    def boom(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, fail_in, boom)
    with pytest.raises(OSError, match="No space"):
        ckpt.save_checkpoint(target, {"v": torch.tensor([2.0])})
    monkeypatch.undo()
    assert target.read_bytes() == before
    assert os.listdir(tmp_path) == ["c.pt"]  # the temporary file was removed


def test_bad_arguments_write_nothing(tmp_path):
    target = tmp_path / "c.pt"
    ckpt.save_checkpoint(target, {"v": 1})
    before = target.read_bytes()
    with pytest.raises(TypeError, match="state must be a dict, got list"):
        ckpt.save_checkpoint(target, [1, 2])
    with pytest.raises(Exception, match="lambda|pickle"):  # cannot be serialised
        ckpt.save_checkpoint(target, {"f": lambda: 0})
    with pytest.raises(TypeError, match="path must be a str or os.PathLike, got int"):
        ckpt.save_checkpoint(3, {"v": 1})
    with pytest.raises(TypeError, match="path must be a str or os.PathLike, got bytes"):
        ckpt.load_checkpoint(b"c.pt")
    with pytest.raises(ValueError, match="path must not be empty"):
        ckpt.save_checkpoint("", {"v": 1})
    with pytest.raises(FileNotFoundError, match="directory of path"):
        ckpt.save_checkpoint(tmp_path / "no" / "c.pt", {"v": 1})
    with pytest.raises(IsADirectoryError, match="is a directory"):
        ckpt.save_checkpoint(tmp_path, {"v": 1})
    assert target.read_bytes() == before
    assert os.listdir(tmp_path) == ["c.pt"]


# ---------------------------------------------------------------------------------------------
# latest_checkpoint.


def test_latest_orders_by_step_number(tmp_path):
    for step in (2, 9, 10, 1):
        ckpt.save_checkpoint(tmp_path / ("step_%d.pt" % step), {"step": step})
    ckpt.save_checkpoint(tmp_path / "other_99.pt", {"step": 99})
    assert ckpt.latest_checkpoint(tmp_path, "step_*.pt") == os.path.join(tmp_path, "step_10.pt")
    assert ckpt.latest_checkpoint(tmp_path, "other_*") == os.path.join(tmp_path, "other_99.pt")
    assert ckpt.latest_checkpoint(tmp_path, "nothing_*") is None
    # key=: order by modification time instead
    os.utime(tmp_path / "step_1.pt", (4e9, 4e9))
    assert ckpt.latest_checkpoint(tmp_path, "step_*.pt", key=os.path.getmtime) == \
        os.path.join(tmp_path, "step_1.pt")


def test_latest_skips_corrupt_and_temporary_files(tmp_path, small_file):
    for step in (10, 20, 30):
        ckpt.save_checkpoint(tmp_path / ("step_%d.pt" % step), {"step": step})
    # The newest is truncated, the next one has a flipped bit: the third is the good one.
    data = (tmp_path / "step_30.pt").read_bytes()
    (tmp_path / "step_30.pt").write_bytes(data[:-3])
    data = bytearray((tmp_path / "step_20.pt").read_bytes())
    data[-10] ^= 1
    (tmp_path / "step_20.pt").write_bytes(bytes(data))
    # A complete temporary file of an interrupted save, and a partial one, both matching.
    (tmp_path / "step_40.pt.x.mpext-tmp").write_bytes(small_file)
    (tmp_path / ".step_50.pt.y.mpext-tmp").write_bytes(small_file[:100])
    os.mkdir(tmp_path / "step_60.pt")  # a directory is not a candidate
    got = ckpt.latest_checkpoint(tmp_path, "step_*")
    assert got == os.path.join(tmp_path, "step_10.pt")
    assert ckpt.load_checkpoint(got)["step"] == 10
    assert ckpt.is_temporary_file(tmp_path / "step_40.pt.x.mpext-tmp")
    assert not ckpt.is_temporary_file("step_40.pt")


def test_latest_bad_arguments(tmp_path):
    with pytest.raises(FileNotFoundError):
        ckpt.latest_checkpoint(tmp_path / "missing")
    with pytest.raises(TypeError, match="pattern must be a non-empty str"):
        ckpt.latest_checkpoint(tmp_path, None)
    with pytest.raises(TypeError, match="key must be callable"):
        ckpt.latest_checkpoint(tmp_path, "*", key=3)
    with pytest.raises(TypeError, match="directory must be a str or os.PathLike"):
        ckpt.latest_checkpoint(None)

