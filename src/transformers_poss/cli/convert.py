"""`poss convert`: turn an official PosS / EAGLE / HASS or EAGLE-3 checkpoint into this library's format."""

from __future__ import annotations


from .errors import add_output_argument, output_argument, positive_int


def add_arguments(parser) -> None:
    parser.add_argument("source", help="Hub id or folder of the official checkpoint (config.json + weights); an "
                        "EAGLE-3 checkpoint (midlayer.*) becomes an eagle3-style draft reading the target layers of "
                        "its eagle_aux_hidden_state_layer_ids (default [2, L // 2, L - 3], which needs --target)")
    add_output_argument(parser, "folder to write (save_pretrained layout, safetensors; new or empty, see --overwrite)")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a non-empty folder: replace the draft's files, keep the others")
    parser.add_argument("--target", default=None, help="embedded name, Hub id or folder of the target (recommended: "
                        "records its fingerprint and drops a stored embedding equal to the target's)")
    parser.add_argument("--positions-per-specialist", type=positive_int, default=None,
                        help="N of PosS-N; read from 'PosS<N>' in the source name when omitted")


def convert_official(repo_id_or_folder: str, output_dir: str, target=None, positions_per_specialist=None,
                     overwrite: bool = False, **kwargs) -> str:
    """Convert an official checkpoint to this library's format (``save_pretrained`` folder); returns ``output_dir``.

    A non-empty ``output_dir`` (or the checkpoint's own folder) is refused unless ``overwrite``."""
    from ..checkpoints.folders import check_output_folder, staged_folder
    from ..modeling_poss import PosSDraftModel

    check_output_folder(output_dir, overwrite, source=repo_id_or_folder)
    model = PosSDraftModel.from_official(repo_id_or_folder, target=target, positions_per_specialist=positions_per_specialist,
                                         **kwargs)  # fmt: skip
    with staged_folder(output_dir) as staging:
        model.save_pretrained(staging)
    return output_dir


def run(args) -> int:
    from ..checks import require_local_path
    from .loaders import load_target

    from ..checkpoints.folders import check_output_folder

    output_argument(args, "convert")
    require_local_path(args.source, "checkpoint folder")  # before the target loads
    check_output_folder(args.output, args.overwrite, source=args.source)
    if args.target:
        require_local_path(args.target, "target folder")
    target = None
    if args.target:
        target, _ = load_target(args.target)
    out = convert_official(args.source, args.output, target=target, positions_per_specialist=args.positions_per_specialist,
                           overwrite=args.overwrite)
    from ..configuration_poss import PosSDraftConfig

    config = PosSDraftConfig.from_pretrained(out)
    if config.feature_layers is not None:
        print(f"{config.layer_style}-style draft reading the target's feature layers {config.feature_layers}")
    print(f"wrote {out}")
    return 0
