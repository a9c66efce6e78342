"""Media types and file names of a Cuvil artifact.

The OCI side follows the image-spec's artifact guidance
(https://github.com/opencontainers/image-spec/blob/main/manifest.md#guidelines-for-artifact-usage):
a manifest with ``artifactType`` ARTIFACT_TYPE, a config of CONFIG and one layer per file below.
On disk, the same files sit in a directory or a tar; FILE_MEDIA_TYPES ties the two forms together.
"""

ARTIFACT_TYPE = "application/vnd.cuvil.artifact.v1"
CONFIG = "application/vnd.cuvil.config.v1+json"
GRAPH = "application/vnd.cuvil.graph.v1+json"
WEIGHTS = "application/vnd.cuvil.weights.v1+safetensors"
GOLDEN = "application/vnd.cuvil.golden.v1+safetensors"
KERNELS = "application/vnd.cuvil.kernels.v1.tar"
REPORT = "application/vnd.cuvil.report.v1+json"

CONFIG_FILE = "config.json"
GRAPH_FILE = "graph.json"
WEIGHTS_FILE = "weights.safetensors"
GOLDEN_FILE = "golden.safetensors"
KERNELS_FILE = "kernels.tar"
# A decoder LLM compiled for generation: ``graph.json`` is its decode step, this its prefill
# (both over the weights file), and the config's ``generation`` entry the KV cache layout.
PREFILL_GRAPH_FILE = "prefill_graph.json"
# A tokenizer's files, when the source model has them: JSON data, read but never executed.
TOKENIZER = "application/vnd.cuvil.tokenizer.v1+json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# Layer files (everything but the config), in the order they are written and pushed.
FILE_MEDIA_TYPES: dict[str, str] = {
    GRAPH_FILE: GRAPH,
    WEIGHTS_FILE: WEIGHTS,
    GOLDEN_FILE: GOLDEN,
    KERNELS_FILE: KERNELS,
    PREFILL_GRAPH_FILE: GRAPH,
    **{name: TOKENIZER for name in TOKENIZER_FILES},
}

# OCI media types (https://github.com/opencontainers/image-spec/blob/main/media-types.md).
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_EMPTY = "application/vnd.oci.empty.v1+json"
OCI_LAYOUT_VERSION = "1.0.0"

# Annotation keys. Pre-defined keys: https://github.com/opencontainers/image-spec/blob/main/annotations.md
ANNOTATION_TITLE = "org.opencontainers.image.title"
ANNOTATION_REF_NAME = "org.opencontainers.image.ref.name"
ANNOTATION_TARGET = "dev.cuvil.target"
ANNOTATION_PRECISION = "dev.cuvil.precision"
ANNOTATION_NAME = "dev.cuvil.name"
ANNOTATION_ARTIFACT_TYPE = "dev.cuvil.artifact-type"
