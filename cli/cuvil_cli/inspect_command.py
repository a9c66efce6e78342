"""``cuvil inspect PATH``: signature, op histogram, report and IR text of an artifact; for a
reference also who signed each manifest, checked against ``--trusted-key``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cuvil.analysis.memory import plan_memory
from cuvil.analysis.memory_report import lifetime_chart, memory_table
from cuvil.artifact import describe_reference, resolve_model
from cuvil.artifact.files import ArtifactContents, read_artifact
from cuvil.artifact.kernels_layer import unpack_kernels
from cuvil.artifact.reference import is_artifact_path, is_oci_reference
from cuvil.ir_dot import graph_to_dot, render_svg
from cuvil.ir_text import print_graph
from cuvil.runtime.signature import Signature
from cuvil_cli.oci_commands import add_registry_arguments, print_description, registry_config_from
from cuvil_cli.trust_commands import add_trust_arguments, trust_from


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("inspect", help="show an artifact's signature, ops and IR")
    parser.add_argument("path", help="artifact file or directory, or a registry/oci: REF")
    parser.add_argument("--ir", action="store_true", help="print the IR text")
    parser.add_argument("--json", action="store_true", help="print config and histogram as JSON")
    parser.add_argument("--dot", type=Path, help="write a Graphviz picture of the graph (DOT)")
    parser.add_argument("--svg", type=Path, help="write the picture as SVG (needs Graphviz)")
    parser.add_argument(
        "--memory",
        action="store_true",
        help="run the artifact on its golden inputs: planned vs naive vs measured activation "
        "memory, and a chart of the buffers' lifetimes",
    )
    add_registry_arguments(parser)
    add_trust_arguments(parser, policy=False)
    parser.set_defaults(handler=run_inspect)


def run_inspect(args: argparse.Namespace) -> int:
    if is_oci_reference(args.path) and not is_artifact_path(args.path):
        registry = registry_config_from(args)
        keys = trust_from(args, policy="warn").keys
        described = describe_reference(args.path, registry_config=registry, trusted_keys=keys)
        if args.json and not args.ir:
            print(json.dumps(described, indent=2))
            return 0
        print_description(described)
        if not args.ir:
            return 0
        args.path = str(resolve_model(args.path, registry_config=registry))
    contents = read_artifact(args.path)
    config, graph = contents.config, contents.graph
    histogram = graph.op_histogram()
    if args.json:
        print(json.dumps({"config": config, "op_histogram": histogram}, indent=2))
        return 0
    print(
        f"{config.get('name')}  target={config.get('target')}  precision={config.get('precision')}"
    )
    print(f"cuvil {config.get('cuvil_version')}, torch {config.get('torch_version')}")
    print("signature:")
    print(Signature.of_graph(graph).describe())
    print(f"ops ({len(graph.nodes)} nodes):")
    for op, count in histogram.items():
        print(f"  {count:5d}  {op}")
    report = config.get("report", {})
    if report:
        print_report(report)
    for name, entry in sorted(config.get("files", {}).items()):
        print(f"  {name}: {entry['size']} bytes {entry['digest']}")
    print_kernels(unpack_kernels(contents.kernels))
    if args.memory:
        print_memory(contents)
    if args.ir:
        print(print_graph(graph), end="")
    if args.dot or args.svg:
        dot_text = graph_to_dot(graph)
        if args.dot:
            args.dot.write_text(dot_text)
        if args.svg:
            args.svg.write_bytes(render_svg(dot_text))
        print(f"picture: {args.dot or ''} {args.svg or ''}".strip())
    return 0


def print_memory(contents: ArtifactContents) -> None:
    """Load the model here, settle it on the golden inputs, measure one call's peak."""
    from cuvil.runtime.model import CompiledModel

    model = CompiledModel(contents)
    inputs = {
        name.removeprefix("input."): tensor
        for name, tensor in contents.golden.items()
        if name.startswith("input.")
    }
    if set(inputs) != set(model.signature.input_names):
        print("memory: the artifact holds no golden inputs to run")
        return
    model.prepare(inputs)
    symbols = model.bind(inputs)
    plan = plan_memory(model.graph, symbols, planner=model.memory_policy.planner)
    measured = model.measure_memory(inputs)["measured_bytes"]
    where = ", ".join(f"{k}={v}" for k, v in symbols.items()) or "static shapes"
    print(f"memory at {where} ({model.memory_policy.planner} planner, {len(plan.sizes)} buffers):")
    for line in memory_table(plan, measured):
        print(line)
    print("lifetimes:")
    for line in lifetime_chart(model.graph, plan):
        print(line)


def print_kernels(files: dict[str, bytes]) -> None:
    """The compiled kernels of the kernels layer, per architecture (``<kernel>.<arch>.cubin``),
    and the PTX kept as the fallback image (``<kernel>.<arch>.ptx``)."""
    for suffix, what in ((".cubin", "kernels"), (".ptx", "PTX fallback")):
        by_arch: dict[str, list[str]] = {}
        for name, data in sorted(files.items()):
            kernel, _, arch = name.removesuffix(suffix).rpartition(".")
            if name.endswith(suffix) and kernel:
                by_arch.setdefault(arch, []).append(f"{kernel} ({len(data)} bytes)")
        for arch, kernels in sorted(by_arch.items()):
            print(f"{what} for {arch} ({len(kernels)}):")
            for kernel in kernels:
                print(f"  {kernel}")


def print_report(report: dict) -> None:
    """Compile time per stage, op counts before and after, and how often each pattern fired."""
    verification = report.get("verification", {}).get("max_relative_to_scale")
    stages = ", ".join(f"{s['name']} {s['seconds']:.2f}s" for s in report.get("stages", []))
    print(f"compile: {report.get('compile_seconds')}s ({stages})")
    print(f"ops: {report.get('ops_before')} before passes, {report.get('ops_after')} after")
    method = report.get("verification", {}).get("method")
    print(
        f"verified: max error {verification} of the output scale"
        + (f", {method}" if method else "")
    )
    fusions = report.get("fusions") or {}
    if fusions:
        print(
            "patterns: " + ", ".join(f"{name} x{count}" for name, count in sorted(fusions.items()))
        )
    if report.get("bisection"):
        print(f"bisection: {report['bisection']}")
