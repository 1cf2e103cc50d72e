"""`poss generate`: answer one prompt with a target model, optionally with PosS tree speculation.

The answer streams to stdout as it is generated (transformers' `TextStreamer`: with a draft, each round's accepted
tokens at once); ``--no-stream`` prints it when generation is done. Either way the text is the decoded new tokens,
and generation is the same call (a streamer does not change what is generated). Speed and acceptance go to stderr.
"""

from __future__ import annotations

import sys
import time

import torch

from .errors import non_negative_int, positive_int, probability, temperature, tree_total_tokens


def add_arguments(parser) -> None:
    """Register the `poss generate` options."""
    parser.add_argument("prompt", nargs="?", default=None, help="prompt text (read from stdin when omitted)")
    parser.add_argument("--target", default="smollm2-135m-instruct",
                        help="embedded name (smollm2-135m-instruct, gemma3-270m), Hub id or folder")
    parser.add_argument("--draft", default=None, help="PosS draft (folder or Hub id) for tree speculation")
    parser.add_argument("--max-new-tokens", type=positive_int, default=256)
    parser.add_argument("--temperature", type=temperature, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=probability, default=None)
    parser.add_argument("--top-k", type=non_negative_int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tree-depth", type=positive_int, default=None)
    parser.add_argument("--tree-top-k", type=positive_int, default=None)
    parser.add_argument("--tree-total-tokens", type=tree_total_tokens, default=None, help="node count or 'auto'")
    parser.add_argument("--chat-template", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--threads", type=positive_int, default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--quantize", choices=["none", "int8"], default="none",
                        help="int8: dynamic int8 weights for the target (CPU only)")
    parser.add_argument("--quiet", action="store_true", help="print only the generated text")
    parser.add_argument("--no-stream", action="store_true",
                        help="print the answer when generation is done instead of streaming it as it is generated")


def run(args) -> int:
    """Generate and print the answer; speed and acceptance go to stderr."""
    import transformers_poss  # noqa: F401  (makes generate() tree-aware)

    from ..bench.methods import GenerationSettings, tree_shape
    from .loaders import DTYPES, encode_prompt, load_draft, load_target, quantized, uses_chat_template

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    text = read_prompt(args.prompt)
    check_arguments(args, text)
    target, tokenizer = load_target(args.target, dtype=DTYPES[args.dtype], device=device)
    target = quantized(target, args.quantize)
    chat = {"on": True, "off": False}.get(args.chat_template)
    if chat is None:
        chat = uses_chat_template(args.target, tokenizer)
    input_ids, mask = encode_prompt(tokenizer, text, chat, device)
    settings = GenerationSettings(args.max_new_tokens, args.temperature, args.top_p, args.top_k)
    kwargs = {"input_ids": input_ids, "attention_mask": mask, "return_dict_in_generate": True,
              **settings.generate_kwargs()}
    draft = quantized(load_draft(args.draft, target), args.quantize) if args.draft else None
    if not args.no_stream:
        from transformers import TextStreamer

        kwargs["streamer"] = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    if draft is None:
        output = target.generate(**kwargs)
    else:
        with tree_shape(draft, args.tree_depth, args.tree_top_k, args.tree_total_tokens):
            output = target.generate(**kwargs, assistant_model=draft)
    seconds = time.perf_counter() - start
    new_tokens = output.sequences[0, input_ids.shape[1]:]
    if args.no_stream:  # else the streamer has printed it, ending with a newline
        print(tokenizer.decode(new_tokens, skip_special_tokens=True))
    if not args.quiet:
        print(_stats(len(new_tokens), seconds, getattr(output, "acceptance", None)), file=sys.stderr)
    return 0


def read_prompt(argument: str | None, stdin=None) -> str:
    """The prompt argument, or stdin's text when it is omitted; text that is not UTF-8 is refused with the byte and
    its offset (a traceback from the tokenizer otherwise)."""
    if argument is not None:
        try:
            argument.encode("utf-8")
        except UnicodeEncodeError as error:  # undecodable command-line bytes arrive as surrogates
            raise ValueError(f"the prompt argument is not UTF-8 text (a byte that is not UTF-8 at character "
                             f"{error.start + 1}); pass UTF-8 text, e.g. convert it with iconv -t UTF-8.") from None
        return argument
    stream = stdin or getattr(sys.stdin, "buffer", None)
    data = stream.read() if stream is not None else sys.stdin.read()  # a text stream when stdin was replaced
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise ValueError(f"the prompt on stdin is not UTF-8 text (byte 0x{data[error.start]:02x} at offset "
                         f"{error.start}); pipe in UTF-8 text, e.g. through iconv -t UTF-8.") from None


def check_arguments(args, text: str) -> None:
    """Everything `poss generate` can check before loading a model (numbers are checked by their argparse types)."""
    from ..checks import check_device, require_local_path
    from ..checkpoints.loading import check_draft_source

    if not text.strip():
        where = "on stdin" if args.prompt is None else "given"
        raise ValueError(f"the prompt {where} is empty: pass the prompt text as an argument or pipe it in.")
    require_local_path(args.target, "target folder")
    check_device(args.device, args.quantize)
    if args.draft:
        check_draft_source(args.draft)


def _stats(count: int, seconds: float, acceptance) -> str:
    line = f"[{count} tokens in {seconds:.2f} s, {count / max(seconds, 1e-9):.1f} tokens/s"
    mean = getattr(acceptance, "mean_acceptance_length", None)
    if mean is not None:
        line += f", mean acceptance length {float(mean):.2f} (bonus token included)"
    return line + "]"
