"""The Ascend deploy bundle (`graphconv compile --bundle DIR`): everything needed to take a compiled model to an
Ascend host, by three routes, and to check the device's numbers there.

    model/      the MindIR (and its `_variables/` folder), hard-linked when possible
    source/     the generated MindSpore network.py and network.ckpt
    onnx/       the simplified ONNX, and a copy at the opset the chosen CANN's ATC accepts when that differs
    reference/  reference inputs and outputs (.npz keyed by graph input / output name), cases.json
    compare_outputs.py    numpy-only comparison of a device run with the reference (graphconv's rule)
    mindspore/  route (a): mindspore.load + nn.GraphCell                       [Ascend host]
    lite/       route (b): converter_lite config and script, Lite inference    [Ascend host]
    atc/        route (c): ATC from the ONNX (--framework=5), and from AIR     [Ascend host]
    README.md, manifest.json

Nothing in the bundle imports graphconv. Where each job lives:

    options.py    the ATC and converter_lite option tables (with their documentation), the CANN -> ONNX opset
                  table, and the linter every written command and config passes (check_command, ...)
    profiles.py   symbolic dims, --shape-range ranges and the dynamic-shape profiles
    opset.py      the ONNX down-converted to the opset ATC accepts, re-checked with onnxruntime
    scripts.py    the templates/ files filled in, and compare_outputs.py assembled from graphconv.verify.compare
    writer.py     BundleContext and write_bundle: the files, the route plan, README, manifest, the self-check
"""

from __future__ import annotations

from graphconv.deploy.opset import AtcOnnx, clamp_opset
from graphconv.deploy.options import (CANN_OPSETS, CONVERTER_LITE, DEFAULT_CANN, DOC, PRECISIONS, TOOLS, ATC,
                                      CommandError, Opt, Tool, cann_opset_range, check_command, check_lite_config,
                                      command, extract_commands, parse_lite_config, shell_line)
from graphconv.deploy.profiles import MAX_PROFILES, Dims, atc_input_shape, collect_dims, profile_values, profiles
from graphconv.deploy.scripts import compare_script
from graphconv.deploy.writer import BundleContext, check_bundle, check_options, write_bundle
from graphconv.deploy.writer import _json, _Plan, _Writer  # noqa: F401 - for tests/test_bundle.py, not the API

__all__ = [
    "ATC", "CANN_OPSETS", "CONVERTER_LITE", "DEFAULT_CANN", "DOC", "MAX_PROFILES", "PRECISIONS", "TOOLS",
    "AtcOnnx", "BundleContext", "CommandError", "Dims", "Opt", "Tool",
    "atc_input_shape", "cann_opset_range", "check_bundle", "check_command", "check_lite_config", "check_options",
    "clamp_opset", "collect_dims", "command", "compare_script", "extract_commands", "parse_lite_config",
    "profile_values", "profiles", "shell_line", "write_bundle",
]
