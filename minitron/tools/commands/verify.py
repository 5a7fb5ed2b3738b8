"""`minitron verify`: a layout's steps against the same steps on one device (tools/verify.py)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ...config import validate
from ..output_paths import check_outputs, inputs_of
from ..preflight import finite_positive
from .options import add_run_args, check_data, layout_from, model_from, train_from
from .ranks import reporting, run_ranks


def add_parser(sub) -> None:
    """`verify`: the layout flags with float64, three steps and a global batch the layout picks."""
    ve = sub.add_parser("verify", help="prove a layout equals the single-device model")
    add_run_args(ve, steps=3, global_batch=0, dtype="float64")
    ve.add_argument("--json", action="store_true")
    ve.add_argument("--tol", type=float, default=None, help="tolerance (default by dtype)")
    ve.set_defaults(fn=cmd_verify)


def cmd_verify(args) -> int:
    """`minitron verify`: exit 0 when the layout's steps equal one device's within the tolerance."""
    from ..verify import verify_job

    model, layout = model_from(args), layout_from(args)
    gb = args.global_batch or layout.data_replicas * args.microbatches * max(2, layout.cube_q ** 2, layout.summa_q * layout.tp_depth)
    train = train_from(args, global_batch=gb, lr=args.lr or 1e-2, warmup=1, eval_every=0, progress=False)
    validate(model, layout, train)
    if args.tol is not None:
        finite_positive("--tol", args.tol)
    corpus = check_data(model, train)
    check_outputs({"--trace": train.trace, "--timeline": train.timeline}, inputs_of(train))
    for path in (train.trace, train.timeline):
        if path:
            Path(path).unlink(missing_ok=True)
    if reporting():  # the ranks' start-up (each imports torch) is the first silent stretch
        print(f"verify: starting {layout.world} ranks, then {train.steps} steps of {layout.describe()} and the same "
              f"steps on one device", file=sys.stderr, flush=True)
    res = run_ranks(verify_job, model, layout, train, corpus, {"timeout": args.timeout, "tol": args.tol})
    if not reporting():
        return 0
    if not args.json:
        print(f"verify {res['layout']} vs single device, {res['steps']} steps, {train.dtype}"
              f"{' with bf16 compute' if layout.precision == 'bf16' else ''}:")
        print(f"  max |loss diff|        {res['max_loss_abs_diff']:.3e}")
        print(f"  max param rel diff     {res['max_param_rel_diff']:.3e}   (worst: {res['worst_param']})")
        if "fn_rel_diff" in res:  # bf16: the verdict is the function's (tools/verify.py, bf16_measures)
            within = all(d <= b for d, b in zip(res["loss_abs_diffs"], res["loss_bounds"]))
            print(f"  losses within bf16     {'yes' if within else 'NO'}   (step i: 4 x 2^-8 x i x |loss|)")
            print(f"  function rel diff      {res['fn_rel_diff']:.3e}   (held-out logits vs training's change; "
                  f"one device, another split: {res.get('rounding_fn_rel_diff', float('nan')):.1e})")
            print(f"  worst tensor's effect  {res['max_tensor_fn_rel_diff']:.3e}   ({res['worst_tensor']}; "
                  f"of its training's effect, bound 1)")
        for name, effect in res.get("judged_by_effect", {}).items():  # float32: tensors the loss cannot see
            print(f"  effect of {name:<12} {effect:.3e}   (its values differ beyond the tolerance: judged by what "
                  f"they do to the held-out logits, of its training's effect)")
        print(f"  tolerance              {res['tolerance']:.1e}  ->  {'OK' if res['ok'] else 'FAILED'}")
    else:
        print(json.dumps(res))
    return 0 if res["ok"] else 1
