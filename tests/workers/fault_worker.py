"""examples/pretrain_gpt.py with one injected fault, for tests/integration/test_faults.py.

    python tests/workers/fault_worker.py FAULT -- <pretrain_gpt.py flags>      (or under torchrun)

FAULT (the test side's monkeypatches; the trainer has no test hooks):

* ``kill:POINT:ITER:RANK``: SIGKILL rank RANK while it saves the checkpoint of iteration ITER, at
  POINT: ``save_start`` (entry of ``dist_checkpointing.save``), ``after_common`` (``common.pt``
  written), ``torn_shard`` (this rank's shard files written, the first cut to half its size),
  ``before_metadata_json`` (megatron-core's ``metadata.json`` not yet written), ``before_commit``
  (``dist_checkpointing.save`` returned; before the flush and rename), ``torch_file`` (``--ckpt-format
  torch``: this rank's file half written), ``after_rename`` (directory renamed; tracker not yet
  replaced), ``tracker_replace`` (new tracker written to its temporary file; not yet replaced).
* ``nan_grad:ITER:RANK:PARAM``: after the gradient all-reduce of iteration ITER, rank RANK's
  gradient of PARAM becomes NaN (the other ranks' stay finite).
* ``nan_param:PARAM``: before the first step (after ``--load``), PARAM's values become NaN on
  every rank (NaN loss).
* ``peak:TFLOPS``: pretend every rank is a GPU with that dense peak.
"""

import os
import signal
import sys


def _die():
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install(spec: str) -> None:
    import megatron_mtraining.training.checkpoint as ckpt
    import megatron_mtraining.training.loop as loop

    kind, *rest = spec.split(":")
    rank = int(os.environ.get("RANK", "0"))
    if kind == "kill":
        point, it, at_rank = rest[0], int(rest[1]), int(rest[2])
        saving = {"iteration": None, "tmp": None}
        orig_save = loop.save_checkpoint

        def save_checkpoint(args, iteration, *a, **k):
            saving["iteration"] = iteration
            saving["tmp"] = os.path.join(args.save, f"iter_{iteration:07d}{ckpt.TMP_SUFFIX}")
            return orig_save(args, iteration, *a, **k)

        loop.save_checkpoint = save_checkpoint

        def armed():
            return saving["iteration"] == it and rank == at_rank

        def kill_before(owner, name):
            orig = getattr(owner, name)

            def wrapper(*a, **k):
                if armed():
                    _die()
                return orig(*a, **k)

            setattr(owner, name, wrapper)

        def kill_after(owner, name, static=False, then=None):
            orig = getattr(owner, name)

            def wrapper(*a, **k):
                out = orig(*a, **k)
                if armed():
                    if then is not None:
                        then()
                    _die()
                return out

            setattr(owner, name, staticmethod(wrapper) if static else wrapper)

        def cut_first_file(prefix):
            files = sorted(f for f in os.listdir(saving["tmp"]) if f.startswith(prefix))
            path = os.path.join(saving["tmp"], files[0])
            os.truncate(path, os.path.getsize(path) // 2)

        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing import serialization
        from megatron.core.dist_checkpointing.strategies import common, filesystem_async

        if point == "save_start":        # both names: the CPU shim wraps serialization.save later
            kill_before(serialization, "save")
            dist_checkpointing.save = serialization.save
        elif point == "after_common":
            kill_after(common.TorchCommonSaveStrategy, "save_common")
        elif point == "torn_shard":
            kill_after(filesystem_async.FileSystemWriterAsync, "write_preloaded_data_multiproc", static=True,
                       then=lambda: cut_first_file(f"__{rank}_"))
        elif point == "before_metadata_json":
            kill_before(serialization, "save_config")
        elif point == "before_commit":
            kill_before(ckpt, "_commit_checkpoint")
        elif point == "torch_file":
            import torch

            orig_torch_save = torch.save

            def torch_save(obj, f, *a, **k):
                out = orig_torch_save(obj, f, *a, **k)
                if armed() and str(f).endswith(".pt"):
                    os.truncate(f, os.path.getsize(f) // 2)
                    _die()
                return out

            torch.save = torch_save
        elif point == "after_rename":
            kill_before(ckpt, "_write_tracker")
        elif point == "tracker_replace":
            orig_replace = os.replace

            def replace(src, dst, *a, **k):
                if armed() and str(dst).endswith(ckpt.TRACKER):
                    _die()
                return orig_replace(src, dst, *a, **k)

            os.replace = replace
        else:
            raise SystemExit(f"fault_worker: unknown kill point {point!r}")
    elif kind == "nan_grad":
        it, at_rank, param = int(rest[0]), int(rest[1]), rest[2]
        import megatron.core.distributed as mcd

        orig_finalize = mcd.finalize_model_grads
        calls = {"n": 0}

        def finalize_model_grads(models, *a, **k):
            out = orig_finalize(models, *a, **k)
            calls["n"] += 1
            if calls["n"] == it and rank == at_rank:
                for name, p in models[0].named_parameters():
                    if name.endswith(param):
                        p.main_grad.view(-1)[0] = float("nan")
            return out

        mcd.finalize_model_grads = finalize_model_grads
    elif kind == "nan_param":
        param = rest[0]
        orig_guard = loop.NanGuard

        def poison_then_guard(args, model, device):      # built after --load, before the first step
            import torch

            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith(param):
                        p.fill_(float("nan"))
            return orig_guard(args, model, device)

        loop.NanGuard = poison_then_guard
    elif kind == "peak":
        import megatron_mtraining.training.faults as faults

        faults.device_peak_tflops = lambda device, dtype: (float(rest[0]), "Test GPU")
    else:
        raise SystemExit(f"fault_worker: unknown fault {spec!r}")


if __name__ == "__main__":        # the checkpoint writer forks: keep the set-up under the main guard
    sep = sys.argv.index("--")
    install(sys.argv[1])
    from megatron_mtraining.training import main

    sys.exit(main(sys.argv[sep + 1:]))
