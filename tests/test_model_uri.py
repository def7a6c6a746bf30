"""The model URI grammar (slipstream.api_types.model_uri): one parser for spec.model.uri and
slipstream serve --model, each form into its parts, and what it refuses with the reason why."""
from __future__ import annotations

import fnmatch

import pytest

import re

from slipstream.api_types.model_uri import (SERVER_SCHEMES, SPEC_SCHEMES, SPEC_URI_PATTERN, ModelURIError,
                                            forms, parse_model_uri)


def test_each_form_parses_into_its_parts():
    assert parse_model_uri("builtin").scheme == "builtin"
    sim = parse_model_uri("sim:llama3-8b-h100,time_scale=0.5,output_len=20-200,seed=7")
    assert (sim.scheme, sim.profile) == ("sim", "llama3-8b-h100,time_scale=0.5,output_len=20-200,seed=7")
    hf = parse_model_uri("hf://Org/Model-1.5B@v1.0:*Q4_K_M.gguf")
    assert (hf.scheme, hf.repo_id, hf.revision, hf.filename) == ("hf", "Org/Model-1.5B", "v1.0", "*Q4_K_M.gguf")
    bare = parse_model_uri("Org/Model")
    assert (bare.scheme, bare.repo_id, bare.revision, bare.filename) == ("hf", "Org/Model", "main", None)
    s3 = parse_model_uri("s3://my-bucket/models/llama/")
    assert (s3.scheme, s3.bucket, s3.prefix) == ("s3", "my-bucket", "models/llama")
    pvc = parse_model_uri("pvc://weights/llama/8b/")
    assert (pvc.scheme, pvc.claim, pvc.path) == ("pvc", "weights", "llama/8b")
    assert parse_model_uri("pvc://weights").path == ""
    oci = parse_model_uri("oci://127.0.0.1:5000/models/smollm2@sha256:" + "a" * 64)
    assert (oci.scheme, oci.reference) == ("oci", "127.0.0.1:5000/models/smollm2@sha256:" + "a" * 64)


def test_the_identity_is_the_canonical_uri_of_hub_and_s3_models():
    assert parse_model_uri("Org/Model:q8_0").identity == "hf://Org/Model@main:*[Qq]8_0*.gguf"
    assert parse_model_uri("hf://Org/Model@v1").identity == "hf://Org/Model@v1"
    assert parse_model_uri("s3://bucket/a/b/").identity == "s3://bucket/a/b"
    assert parse_model_uri("pvc://c/x").identity == "pvc://c/x"


def test_a_quantization_tag_is_a_glob_of_either_case_and_a_glob_stays_as_given():
    glob = parse_model_uri("hf://o/n:q4_k_m").filename
    assert fnmatch.fnmatchcase("model.Q4_K_M.gguf", glob) and fnmatch.fnmatchcase("model-q4_k_m.gguf", glob)
    assert not fnmatch.fnmatchcase("model.Q8_0.gguf", glob)
    assert parse_model_uri("hf://o/n:model.gguf").filename == "model.gguf"


@pytest.mark.parametrize("text", ["/models/x.gguf", "./m", "../m", "~/m", "file:///models/m", "model.gguf",
                                  "org/name/extra"])
def test_local_paths_are_a_form_only_where_asked_for(text):
    local = parse_model_uri(text, local_paths=True)
    assert local.scheme == "local" and local.path == (text.removeprefix("file://"))
    with pytest.raises(ModelURIError):
        parse_model_uri(text)


@pytest.mark.parametrize("text, why", [
    ("", "empty"), ("  ", "empty"),
    ("sim:", "the profile must be"), ("sim:Tiny", "the profile must be"), ("sim:tiny,speed=2", "the profile must be"),
    ("hf://org", "not a Hugging Face model id"), ("hf://-org/name", "not a Hugging Face model id"),
    ("hf://org/name/extra", "not a Hugging Face model id"), ("hf://datasets/squad", "not a Hugging Face model id"),
    ("hf://org/na..me", "not a Hugging Face model id"), ("hf://org/name@", "empty revision"),
    ("hf://org/name:", "empty file selector"), ("hf://org/name@a@b", "one '@REVISION'"),
    ("hf://org/name:a:b", "one '@REVISION'"), ("hf://org/name@v 1", "without spaces"),
    ("s3://Models/x", "not an S3 bucket name"), ("s3://ab/x", "not an S3 bucket name"),
    ("s3://models/a b", "no spaces"),
    ("pvc://Weights/x", "a PVC URI is"), ("pvc:///x", "a PVC URI is"), ("pvc://weights/../etc", "a PVC URI is"),
    ("oci://ghcr.io/Org/model:1", "an OCI URI is"), ("oci://ghcr.io", "an OCI URI is"),
    ("oci://ghcr.io/org/model:", "an OCI URI is"),
    ("ftp://example/model", "scheme ftp:// is not supported"), ("http://example/model", "scheme http:// is not"),
])
def test_what_is_not_a_model_uri_says_why(text, why):
    with pytest.raises(ModelURIError, match="model URI") as info:
        parse_model_uri(text, local_paths=True)
    assert why in info.value.why and info.value.text == text


def test_file_uris_need_a_path_and_are_local_only():
    with pytest.raises(ModelURIError, match="names no path"):
        parse_model_uri("file://", local_paths=True)
    with pytest.raises(ModelURIError, match="file:// is not supported"):
        parse_model_uri("file:///m.gguf")


def test_the_accepted_forms_name_each_scheme_of_a_context():
    assert forms(SPEC_SCHEMES) == ("hf://ORG/NAME[@REVISION][:FILE] (or ORG/NAME[@REVISION][:FILE]), "
                                   "s3://BUCKET/PREFIX, oci://REGISTRY/REPOSITORY[:TAG|@sha256:DIGEST], "
                                   "pvc://CLAIM/PATH, builtin, sim:PROFILE")
    assert "a local path" in forms(SERVER_SCHEMES) and "pvc://" not in forms(SERVER_SCHEMES)


def test_the_grammar_imports_nothing_of_slipstream_but_itself():
    import ast
    from pathlib import Path

    import slipstream.api_types.model_uri as module

    tree = ast.parse(Path(module.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | \
        {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(name and name.startswith("slipstream") for name in imported), imported


@pytest.mark.parametrize("text, parses", [
    ("builtin", True), ("sim:tiny,seed=7", True), ("hf://Org/Model-1.5B@v1.0:*Q4_K_M.gguf", True),
    ("Org/Model", True), ("s3://my-bucket/models/llama/", True), ("pvc://weights", True),
    ("oci://127.0.0.1:5000/models/smollm2@sha256:" + "a" * 64, True), ("oci://ghcr.io/org/model:1", True),
    ("sim:Tiny", False), ("hf://org", False), ("hf://org/name@", False), ("hf://org/name:a:b", False),
    ("hf://org/name@v 1", False), ("hf://" + "o" * 97 + "/n", False), ("s3://ab/x", False),
    ("s3://models/a b", False), ("pvc://Weights/x", False), ("oci://ghcr.io", False),
    ("oci://ghcr.io/org/model:", False), ("ftp://example/model", False), ("/models/x.gguf", False),
])
def test_the_crd_pattern_is_the_grammar(text, parses):
    """SPEC_URI_PATTERN (the API server's check) is composed from the parser's own regexes: it
    accepts what the parser accepts; the parser alone refuses what no regex can say (``..``)."""
    try:
        parse_model_uri(text)
        ours = parse_model_uri(text).scheme in SPEC_SCHEMES
    except ModelURIError:
        ours = False
    assert ours is parses
    assert bool(re.search(SPEC_URI_PATTERN, text)) is parses
