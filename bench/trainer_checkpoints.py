"""Checkpoints inside the trainers, within the RAM budget: Hugging Face ``Trainer`` and Lightning.

A ``LlamaForCausalLM`` built from a config (no download) of about
``--params`` parameters is trained on random tokens for 6 steps with a
checkpoint every 2 (HF: ``save_steps=2``, ``save_total_limit=2``; Lightning:
``ModelCheckpoint`` at every epoch of 2 batches, top 2), once with
``TieredAdamW`` (``ram_budget`` = 1/16 of its state, ``state_dir`` on
``--dir``; ``tierstore.integrations.hf.TieredTrainer`` /
``tierstore.integrations.lightning.TieredCheckpoints``) and once with
``torch.optim.AdamW(fused=True)``. A second process resumes from the step-4
checkpoint and trains to step 6; its weights must equal the uninterrupted
run's bit for bit.

Every run is a child process. The parent samples its RSS from outside
(``/proc/<pid>/status`` every 2 ms) and the child marks when a checkpoint
save and a resume begin and end (and reads the Linux kernel's high-water mark
``VmHWM``, reset at each mark, as a cross-check); a phase's growth is its
peak RSS minus the RSS just before it began. Beside each round, a raw copy of
the same number of bytes as the optimizer state (``O_DIRECT`` reads and
writes of 8 MiB, fsync at the end) on the same drive times what a copy costs.

Targets (issue 23): peak RSS growth of a checkpoint save and of the
optimizer's resume <= ram_budget + 64 MiB for TieredAdamW (torch.optim.AdamW
shown beside it); the snapshot's save time <= 1.2x the raw copy; resumed runs
bitwise equal. Lightning's whole resume is shown too: Lightning loads the
``.ckpt`` (the model's weights) with ``torch.load`` whatever the optimizer, so
it grows by the weights' size; the optimizer's part is what tierstore adds.

Run (about 12 B/param of RAM for the torch runs and 3x the optimizer state of
disk; 2e8 parameters: ~10 GB of RAM, ~12 GB of disk, tens of minutes on 2 cores)::

    python bench/trainer_checkpoints.py --params 2e8 --dir /mnt/nvme/scratch --rounds 3 --json trainer-checkpoints.json

Smoke run (seconds)::

    python bench/trainer_checkpoints.py --params 2e6 --dir /tmp/tc --rounds 1
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

SELF = Path(__file__).resolve()
TRAINERS = ("hf", "lightning")
OPTIMIZERS = ("tiered", "torch")
STEPS, EVERY, RESUME_AT = 6, 2, 4
SAMPLE_S = 0.002
SLACK = 64 << 20  # 64 MiB: the allowance above ram_budget


# -- the child: one training run ------------------------------------------------------------------

def _rss_kib(field: str = "VmRSS", pid: str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class Marks:
    """Writes phase marks for the parent (time, name, begin/end) and the kernel's peak per phase."""

    def __init__(self, path: str) -> None:
        self.f = open(path, "a", buffering=1)  # noqa: SIM115 - open for the child's life
        self.open: dict[str, float] = {}

    def begin(self, name: str) -> None:
        if not self.open:  # a phase inside another (the optimizer's part of a save) keeps the outer's peak
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # reset VmHWM to the current RSS
            except OSError:
                pass
        self.open[name] = time.time()
        self.f.write(json.dumps({"t": self.open[name], "phase": name, "edge": "begin", "rss": _rss_kib() << 10}) + "\n")

    def end(self, name: str) -> None:
        t = time.time()
        self.f.write(json.dumps({"t": t, "phase": name, "edge": "end", "hwm": _rss_kib("VmHWM") << 10,
                                 "seconds": t - self.open.pop(name)}) + "\n")  # fmt: skip

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        real = getattr(owner, attr)

        def marked(*args: Any, **kwargs: Any) -> Any:
            self.begin(name)
            try:
                return real(*args, **kwargs)
            finally:
                self.end(name)

        static = isinstance(inspect.getattr_static(owner, attr), staticmethod)
        setattr(owner, attr, staticmethod(marked) if static else marked)


def _llama(params: float):  # noqa: ANN202
    import torch
    import transformers

    h, inter, vocab = (1024, 2816, 8192) if params >= 5e7 else (128, 352, 512)
    per_layer = 4 * h * h + 3 * h * inter + 2 * h
    layers = max(1, round((params - 2 * vocab * h) / per_layer))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                                      num_attention_heads=max(1, h // 128), num_key_value_heads=max(1, h // 128),
                                      max_position_embeddings=64)  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _tokens(n: int, vocab: int) -> Any:
    import torch

    return torch.randint(0, vocab, (n, 32), generator=torch.Generator().manual_seed(7))


def _digest(model: Any) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


def _tiered_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    return dict(lr=1e-4, weight_decay=0.0, ram_budget="1/16", state_dir=cfg["state_dir"], resume="auto")


def child_hf(cfg: dict[str, Any], marks: Marks) -> dict[str, Any]:
    import torch
    import transformers

    from tierstore import TieredAdamW
    from tierstore.integrations import hf

    model = _llama(cfg["params"])
    ids = _tokens(STEPS, model.config.vocab_size)
    data = [{"input_ids": row, "labels": row} for row in ids]
    tiered = cfg["optimizer"] == "tiered"
    opt_cls = (TieredAdamW, _tiered_kwargs(cfg)) if tiered else (torch.optim.AdamW, dict(lr=1e-4, weight_decay=0.0, fused=True))
    args = transformers.TrainingArguments(
        output_dir=cfg["out"], max_steps=STEPS, per_device_train_batch_size=1, save_strategy="steps", save_steps=EVERY,
        save_total_limit=2, logging_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
        lr_scheduler_type="constant", weight_decay=0.0,
    )  # fmt: skip
    cls = hf.TieredTrainer if tiered else transformers.Trainer
    marks.wrap(cls, "_save_checkpoint", "save")
    marks.wrap(cls, "_save_optimizer_and_scheduler", "save_optimizer")
    marks.wrap(cls, "_load_optimizer_and_scheduler", "resume_optimizer")
    trainer = cls(model=model, args=args, train_dataset=data, optimizer_cls_and_kwargs=opt_cls)
    resume = os.path.join(cfg["out"], f"checkpoint-{RESUME_AT}") if cfg["resume"] else None
    trainer.train(resume_from_checkpoint=resume)
    state = hf.tiered_optimizer(trainer.optimizer).layout.state_nbytes if tiered else _torch_state(trainer.optimizer)
    return {"digest": _digest(model), "state_bytes": state}


def _torch_state(opt: Any) -> int:
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if hasattr(t, "numel") and t.dim())


def child_lightning(cfg: dict[str, Any], marks: Marks) -> dict[str, Any]:
    import lightning as L
    import torch
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    from tierstore import TieredAdamW
    from tierstore.integrations import lightning as tl
    from tierstore.integrations.snapshot import tiered_optimizer

    tiered = cfg["optimizer"] == "tiered"
    model = _llama(cfg["params"])
    ids = _tokens(EVERY, model.config.vocab_size)  # one epoch = EVERY batches: checkpoints at epoch ends

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self):  # noqa: ANN201
            if tiered:
                return TieredAdamW(self.parameters(), **_tiered_kwargs(cfg))
            return torch.optim.AdamW(self.parameters(), lr=1e-4, weight_decay=0.0, fused=True)

    marks.wrap(L.Trainer, "save_checkpoint", "save")
    if tiered:
        marks.wrap(tl.SnapshotCheckpointIO, "_write_snapshot", "save_optimizer")
        marks.wrap(tl, "_load_reference", "resume_optimizer")
    else:
        from lightning.pytorch.strategies import SingleDeviceStrategy

        marks.wrap(SingleDeviceStrategy, "load_optimizer_state_dict", "resume_optimizer")
    # A resume holds the loaded checkpoint from resume_start to resume_end: the phase spans both.
    real_start, real_end = _CheckpointConnector.resume_start, _CheckpointConnector.resume_end

    def resume_start(self, checkpoint_path=None, *a, **k):  # noqa: ANN001, ANN202
        if checkpoint_path:
            marks.begin("resume")
        return real_start(self, checkpoint_path, *a, **k)

    def resume_end(self, *a, **k):  # noqa: ANN202
        out = real_end(self, *a, **k)
        if "resume" in marks.open:
            marks.end("resume")
        return out

    _CheckpointConnector.resume_start, _CheckpointConnector.resume_end = resume_start, resume_end
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=cfg["out"], monitor="step", mode="max", save_top_k=2)
    callbacks = [tl.TieredCheckpoints(), ckpt] if tiered else [ckpt]
    trainer = L.Trainer(max_epochs=STEPS // EVERY, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=cfg["out"], callbacks=callbacks)  # fmt: skip
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=1)
    resume = os.path.join(cfg["out"], f"epoch={RESUME_AT // EVERY - 1}-step={RESUME_AT}.ckpt") if cfg["resume"] else None
    module = Module()
    trainer.fit(module, loader, ckpt_path=resume)
    opt = trainer.optimizers[0]
    state = tiered_optimizer(opt).layout.state_nbytes if tiered else _torch_state(opt)
    return {"digest": _digest(model), "state_bytes": state}


def run_child(cfg: dict[str, Any]) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    marks = Marks(cfg["marks"])
    result = (child_hf if cfg["trainer"] == "hf" else child_lightning)(cfg, marks)
    print("RESULT " + json.dumps(result), flush=True)


# -- the parent: children, RSS from outside, the raw copy -----------------------------------------

def _sample(pid: int, samples: list[tuple[float, int]], stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            samples.append((time.time(), _rss_kib("VmRSS", str(pid)) << 10))
        except (OSError, ValueError):
            return
        time.sleep(SAMPLE_S)


def measure(cfg: dict[str, Any]) -> dict[str, Any]:
    """Run one child; return its result and each phase's growth (outside samples, and VmHWM) and seconds."""
    Path(cfg["marks"]).unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, str(SELF), "--child", json.dumps(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    samples: list[tuple[float, int]] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sample, args=(proc.pid, samples, stop), daemon=True)
    sampler.start()
    out, err = proc.communicate()
    stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"child {cfg['trainer']}/{cfg['optimizer']} failed ({proc.returncode}):\n{err[-4000:]}")
    result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
    phases: dict[str, list[dict[str, float]]] = {}
    begun: dict[str, dict[str, Any]] = {}
    for line in Path(cfg["marks"]).read_text().splitlines():
        mark = json.loads(line)
        if mark["edge"] == "begin":
            begun[mark["phase"]] = mark
            continue
        start = begun.pop(mark["phase"])
        before = [rss for t, rss in samples if t <= start["t"]]
        inside = [rss for t, rss in samples if start["t"] <= t <= mark["t"]]
        base = before[-1] if before else start["rss"]
        outside = max(inside, default=base) - base
        phases.setdefault(mark["phase"], []).append({
            "seconds": mark["seconds"], "growth_outside": outside, "growth_hwm": mark["hwm"] - start["rss"],
            "growth": max(outside, mark["hwm"] - start["rss"]),
        })  # fmt: skip
    return {**result, "phases": phases}


def raw_copy(directory: Path, nbytes: int) -> float:
    """Seconds to copy ``nbytes`` with O_DIRECT reads and writes of 8 MiB on ``directory``'s drive, fsync included."""
    block = 8 << 20
    nbytes = -(-nbytes // block) * block
    src, dst = directory / "raw-src.bin", directory / "raw-dst.bin"
    buf = mmap.mmap(-1, block)
    buf.write(os.urandom(1 << 20) * (block >> 20))
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0)
    fd = os.open(src, flags, 0o600)
    try:
        for _ in range(nbytes // block):
            os.write(fd, buf)
        os.fsync(fd)
    finally:
        os.close(fd)
    t0 = time.perf_counter()
    rfd = os.open(src, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    wfd = os.open(dst, flags, 0o600)
    try:
        while (n := os.readv(rfd, [buf])) > 0:
            os.write(wfd, memoryview(buf)[:n])
        os.fsync(wfd)
    finally:
        os.close(rfd)
        os.close(wfd)
    seconds = time.perf_counter() - t0
    src.unlink()
    dst.unlink()
    buf.close()
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--params", type=float, default=2e8, help="model parameters (default 2e8)")
    parser.add_argument("--dir", type=Path, help="scratch directory on the drive under test (state, checkpoints)")
    parser.add_argument("--trainers", default="hf,lightning", help="hf, lightning or both (default)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each every trainer x optimizer (default 3)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.child:
        run_child(json.loads(args.child))
        return 0
    sys.path.insert(0, str(SELF.parent.parent))
    from tierstore.cli.bench.report import hardware_line, machine_info, write_json
    from tierstore.cli.bench.verdict import Target, format_verdicts, judge
    from tierstore.sizes import format_size

    trainers = [t for t in args.trainers.split(",") if t]
    if not set(trainers) <= set(TRAINERS):
        parser.error(f"--trainers {args.trainers!r}: choose from {', '.join(TRAINERS)}")
    root = Path(args.dir or tempfile.mkdtemp(prefix="tierstore-trainer-ckpt-"))
    root.mkdir(parents=True, exist_ok=True)
    info = machine_info(root)
    print(hardware_line(info))
    print(f"model: LlamaForCausalLM of ~{args.params:.3g} params; {STEPS} steps, a checkpoint every {EVERY}, "
          f"resume from step {RESUME_AT}; ram_budget = 1/16 of TieredAdamW's state; {args.rounds} round(s)")  # fmt: skip
    rows: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for trainer in trainers:
            for optimizer in (OPTIMIZERS if r % 2 == 0 else OPTIMIZERS[::-1]):  # alternate the order
                work = root / f"{trainer}-{optimizer}"
                shutil.rmtree(work, ignore_errors=True)
                base = {"trainer": trainer, "optimizer": optimizer, "params": args.params, "out": str(work / "out"),
                        "state_dir": str(work / "state"), "marks": str(work / "marks.jsonl")}  # fmt: skip
                work.mkdir(parents=True)
                first = measure({**base, "resume": False})
                shutil.rmtree(work / "state", ignore_errors=True)  # the resumed job starts from the checkpoint
                second = measure({**base, "resume": True})
                copy_s = raw_copy(work, first["state_bytes"]) if optimizer == "tiered" else None
                ckpt_bytes = sum(f.stat().st_size for f in (work / "out").rglob("*") if f.is_file())
                shutil.rmtree(work, ignore_errors=True)
                row = {"round": r, "trainer": trainer, "optimizer": optimizer, "state_bytes": first["state_bytes"],
                       "budget": first["state_bytes"] // 16 if optimizer == "tiered" else None,
                       "save": first["phases"].get("save", []), "save_optimizer": first["phases"].get("save_optimizer", []),
                       "resume": second["phases"].get("resume", []),
                       "resume_optimizer": second["phases"].get("resume_optimizer", []),
                       "bitwise": first["digest"] == second["digest"],
                       "raw_copy_s": copy_s, "checkpoint_bytes_on_disk": ckpt_bytes}  # fmt: skip
                rows.append(row)
                peak = {k: max((p["growth"] for p in row[k]), default=None) for k in ("save", "resume", "resume_optimizer")}
                opt_save = statistics.median([p["seconds"] for p in row["save_optimizer"]] or [float("nan")])
                whole = f" (whole resume, the model's weights included: {format_size(peak['resume'])})" if peak["resume"] else ""
                print(f"round {r} {trainer:9} {optimizer:6}: state {format_size(row['state_bytes'])}; peak RSS growth: "
                      f"checkpoint save {format_size(peak['save'] or 0)}, optimizer resume "
                      f"{format_size(peak['resume_optimizer'] or 0)}{whole}; optimizer save {opt_save:.2f} s"
                      + (f" (raw copy {copy_s:.2f} s)" if copy_s else "") + f"; resumed bitwise: {row['bitwise']}")  # fmt: skip

    verdicts = []
    for trainer in trainers:
        mine = [row for row in rows if row["trainer"] == trainer and row["optimizer"] == "tiered"]
        if not mine:
            continue
        allowance = mine[0]["budget"] + SLACK
        for phase, what in (("save", "a checkpoint save"), ("resume_optimizer", "the optimizer's resume")):
            target = Target(f"{trainer}_{phase}_rss", f"{trainer}: peak RSS growth during {what}, "
                            "minus ram_budget + 64 MiB", "<=", 0, unit="B", source="issue 23", min_repeats=1)  # fmt: skip
            verdicts.append(judge(target, [max((p["growth"] for p in row[phase]), default=0) - allowance for row in mine]))
        ratios = [statistics.median(p["seconds"] for p in row["save_optimizer"]) / row["raw_copy_s"] for row in mine]
        verdicts.append(judge(Target(f"{trainer}_save_vs_copy", f"{trainer}: snapshot save time / raw copy of the "
                                     "state's bytes", "<=", 1.2, source="issue 23", more="raise --rounds"), ratios))  # fmt: skip
        verdicts.append(judge(Target(f"{trainer}_bitwise", f"{trainer}: resumed runs not bitwise equal", "<=", 0,
                                     unit="runs", source="issue 23", min_repeats=1),
                              [sum(not row["bitwise"] for row in rows if row["trainer"] == trainer)]))  # fmt: skip
    print(format_verdicts(verdicts))
    if args.json:
        write_json(args.json, {"benchmark": "trainer_checkpoints", "machine": info, "params": args.params,
                               "steps": STEPS, "every": EVERY, "resume_at": RESUME_AT, "rows": rows,
                               "verdicts": verdicts})  # fmt: skip
        print(f"wrote {args.json}")
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
