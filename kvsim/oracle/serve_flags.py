"""Write the option table of one vLLM release's ``vllm serve`` parser, as JSON, for ``kvsim init``.

Run with an oracle environment's python (no GPU: the CPU platform stands in, which only the
parser's defaults read):

    ~/.cache/kvsim/oracle/vllm-0.33.0/bin/python kvsim/oracle/serve_flags.py \
        > kvsim/presets/vllm_serve/0.33.0.json

Every option string the parser accepts (short forms, ``--no-``/``--disable-`` negations) maps to
its destination, whether it takes a value, and for a switch the value it sets.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def main() -> None:
    import vllm
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()  # the parser's defaults ask for a device
    try:
        from vllm.entrypoints.common.cli_args import make_arg_parser
    except ImportError:  # before 0.33
        try:
            from vllm.entrypoints.launchers.cli_args import make_arg_parser  # 0.32
        except ImportError:
            from vllm.entrypoints.openai.cli_args import make_arg_parser
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        from vllm.utils import FlexibleArgumentParser
    parser = make_arg_parser(FlexibleArgumentParser())
    options = {}
    # Every string the parser accepts, hidden ones included (0.33 hides --no-enable-x).
    for opt, action in parser._option_string_actions.items():
        negative = set(getattr(action, "negative_option_strings", ()) or ())
        if opt not in ("-h", "--help"):
            entry = {"dest": action.dest, "takes_value": action.nargs != 0}
            if not entry["takes_value"]:
                if negative or opt.startswith("--no-"):
                    entry["sets"] = opt not in negative and not opt.startswith("--no-")
                elif action.const is not None:
                    entry["sets"] = action.const
            options[opt] = entry
    json.dump({"vllm_version": vllm.__version__, "options": dict(sorted(options.items()))},
              sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
