"""`poss export`: a draft as an EAGLE or EAGLE-3 checkpoint for vLLM / SGLang, or as a transformers `custom_generate`
folder."""

from __future__ import annotations

import sys

from .errors import add_output_argument, output_argument


def add_arguments(parser) -> None:
    parser.add_argument("draft", help="folder or Hub id of the draft (save_pretrained layout)")
    add_output_argument(parser, "folder to write (new or empty; see --overwrite)")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a non-empty folder: replace the files this export writes, keep the others "
                             "(never the draft's own folder, except for custom_generate)")
    parser.add_argument("--format", choices=("eagle", "eagle3", "custom_generate"), default="eagle",
                        help="eagle: Llama config + one layer for vLLM (method 'eagle') and SGLang (EAGLE), S = 1 "
                             "eagle2-style drafts only; eagle3: the EAGLE-3 layout (vLLM method 'eagle3', SGLang "
                             "EAGLE3), S = 1 eagle3-style drafts with feature layers and their own lm_head; "
                             "custom_generate: the draft plus custom_generate/generate.py for "
                             "target.generate(custom_generate=FOLDER, trust_remote_code=True)")
    parser.add_argument("--engine", choices=("vllm", "sglang"), default="vllm",
                        help="eagle: the engine the checkpoint is for (architectures LlamaForCausalLM for vLLM and the "
                             "EAGLE repository, LlamaForCausalLMEagle for SGLang)")
    parser.add_argument("--reduced-vocab", choices=("token-map", "full", "error"), default="token-map",
                        help="eagle, for a draft with a reduced vocabulary: token-map (full-vocabulary checkpoint plus "
                             "hot_token_ids.pt for SGLang --speculative-token-map), full (no map) or error")
    parser.add_argument("--no-fc-bias", action="store_true",
                        help="eagle: leave fc.bias out (for vLLM releases that refuse it; the bias must be zero)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="eagle, eagle3: storage dtype (default: the draft's)")
    parser.add_argument("--repo-id", default=None,
                        help="custom_generate: Hub repo the folder will be pushed to (default draft of generate.py)")


def run(args) -> int:
    import torch

    from ..checks import require_local_path
    from ..checkpoints.export import ExportError, export_custom_generate, export_eagle
    from ..checkpoints.export_eagle3 import export_eagle3
    from ..checkpoints.folders import check_output_folder
    from ..modeling_poss import PosSDraftModel

    output_argument(args, "export")
    require_local_path(args.draft, "draft folder")  # the output and the draft are checked before the draft loads
    check_output_folder(args.output, args.overwrite, source=args.draft, allow_source=args.format == "custom_generate")
    draft = PosSDraftModel.from_pretrained(args.draft)
    overwrite = args.overwrite
    try:
        if args.format == "eagle":
            dtype = getattr(torch, args.dtype) if args.dtype else None
            out = export_eagle(draft, args.output, engine=args.engine, reduced_vocab=args.reduced_vocab,
                               fc_bias=not args.no_fc_bias, dtype=dtype, overwrite=overwrite)
        elif args.format == "eagle3":
            out = export_eagle3(draft, args.output, dtype=getattr(torch, args.dtype) if args.dtype else None,
                                overwrite=overwrite)
        else:
            out = export_custom_generate(draft, args.output, repo_id=args.repo_id, overwrite=overwrite)
    except ExportError as error:
        print(f"poss export: {error}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
