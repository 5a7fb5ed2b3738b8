"""The commands on text and trained weights: `minitron tokenize` (a token file from text),
`sample` (text from a checkpoint or a Hugging Face directory) and `export` (a checkpoint
written as a Hugging Face directory of the family that holds its model: ``hf.export_problem``)."""
from __future__ import annotations

import json

from ...config import ConfigError
from ..output_paths import check_output_file


def add_parsers(sub) -> None:
    """`tokenize`, `sample` and `export`, in that order."""
    tk = sub.add_parser("tokenize", help="train a byte-level BPE on text and write a token file (.bin)")
    tk.add_argument("--data", default="", help="text file or folder of .txt (default: Shakespeare)")
    tk.add_argument("--vocab", type=int, default=4096, help="vocabulary size (256 byte values + merges)")
    tk.add_argument("--out", required=True, help="the .bin to write (with .json and .tokenizer.json beside it)")
    tk.add_argument("--tokenizer", default="", help="encode with this tokenizer.json (e.g. GPT-2's) "
                    "instead of training one (--vocab is then the tokenizer's)")
    tk.add_argument("--json", action="store_true")
    tk.set_defaults(fn=cmd_tokenize)

    sa = sub.add_parser("sample", help="text from a checkpoint (any layout) or a GPT-2 directory")
    sa.add_argument("--ckpt-dir", default="", help="a minitron checkpoint folder (or a --ckpt-dir: its newest)")
    sa.add_argument("--init-from", default="", metavar="HF_DIR",
                    help="a Hugging Face directory (GPT-2, Llama, Qwen2, Qwen3, Mistral, Mixtral, Qwen2-MoE, OLMoE, "
                         "DeepSeek-V3)")
    sa.add_argument("--prompt", default="ROMEO:")
    sa.add_argument("--tokens", type=int, default=200, help="tokens to generate")
    sa.add_argument("--temperature", type=float, default=0.8)
    sa.add_argument("--top-k", type=int, default=40)
    sa.add_argument("--seed", type=int, default=0)
    sa.add_argument("--tokenizer", default="", help="a tokenizer.json (default: --data's, the GPT-2 "
                    "directory's, else bytes)")
    sa.add_argument("--data", default="", help="a token file (.bin) whose tokenizer to use")
    sa.add_argument("--dtype", default="float32", help="float32 or float64")
    sa.set_defaults(fn=cmd_sample)

    ex = sub.add_parser("export", help="write a checkpoint as a Hugging Face directory "
                        "(GPT-2, Llama, Qwen2, Qwen3, Mistral, Mixtral, Qwen2-MoE, OLMoE, DeepSeek-V3)")
    ex.add_argument("--ckpt-dir", required=True, help="a minitron checkpoint folder (or a --ckpt-dir: its newest)")
    ex.add_argument("--hf", required=True, metavar="DIR", help="where to write config.json and model.safetensors")
    ex.set_defaults(fn=cmd_export)


def cmd_tokenize(args) -> int:
    """`minitron tokenize`: a BPE trained (or a tokenizer.json applied) and the token file written."""
    from ...tokenizer import tokenize

    check_output_file("--out", args.out, [args.data, args.tokenizer], extensions=(".bin",))
    res = tokenize(args.data, args.out, args.vocab, args.tokenizer)
    if args.json:
        print(json.dumps(res))
    else:
        print(f"{res['bytes']} bytes of text -> {res['tokens']} tokens ({res['bytes_per_token']:.2f} bytes/token), "
              f"vocabulary {res['vocab']}, {res['dtype']}")
        print(f"wrote {res['out']}, {res['sidecar']}, {res['tokenizer']}")
        print(f"train on it: minitron train --data {res['out']} --vocab {res['vocab']}")
    return 0


def cmd_sample(args) -> int:
    """`minitron sample`: text from a checkpoint or a Hugging Face directory (sampling.py)."""
    from ..sampling import sample_text

    print(sample_text(args))
    return 0


def cmd_export(args) -> int:
    """`minitron export`: a checkpoint written as a Hugging Face directory, checked first."""
    from ...hf import export_problem, save
    from ..sampling import model_from_checkpoint

    from ..output_paths import check_export_dir

    check_export_dir(args.hf, args.ckpt_dir)
    cfg, full, _ = model_from_checkpoint(args.ckpt_dir)
    problem = export_problem(cfg)
    if problem:
        raise ConfigError(f"cannot export {args.ckpt_dir} to Hugging Face: {problem}")
    try:
        res = save(args.hf, {k: v["param"] for k, v in full.items()}, cfg)
    except KeyError as e:  # checksums fine, a tensor missing: written incomplete or forged
        raise ConfigError(f"checkpoint {args.ckpt_dir} does not match the model its meta.json describes: no {e}; "
                          f"export another checkpoint") from None
    print(f"wrote {res['dir']}/config.json and model.safetensors ({res['tensors']} tensors, "
          f"{res['params']:,} parameters, {res['dtype']}): "
          f"transformers.{res['class']}.from_pretrained('{res['dir']}') loads it")
    return 0
