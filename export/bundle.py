"""Model bundles: the directory serving loads, deploy/ ships and every benchmark names.

    BUNDLE/manifest.json   format version, task, model config, tokenizer + special ids, each graph's
                           input/output contract, opset, variant, sha256 of every file, source checkpoint
                           hash, parity figures measured at export, the bundle's `version` (a hash of its
                           content: the same weights exported twice have the same version) and `created`
    BUNDLE/tokenizer.json  (or, for imported Marian models: vocab.json, source.spm, target.spm; see
                           manifest["tokenizer"]["kind"])
    BUNDLE/encoder.onnx    (translation only)
    BUNDLE/decoder.onnx

Owns: writing the manifest (hashing every file), loading and verifying a bundle (format version, every
listed file present and unchanged, no unlisted file, manifest contracts equal to the ones the contract
module derives from the model config), and checking a graph's inputs/outputs against its contract.

TORCH-FREE: serving imports this. Does not own: exporting (export/onnx_export.py), sessions
(serving/engine/runtime.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from export.contract import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    Dims,
    GraphContract,
    decoder_contract,
    decoder_cpu_contract,
    encoder_contract,
    has_cpu_decoder,
)
from model.config import Arch, ModelConfig

TASKS = ("translate", "generate")
TOKENIZER_KINDS = ("bpe", "sentencepiece")


class BundleError(ValueError):
    """A bundle is missing, incomplete, tampered with or inconsistent; the message names the file."""


class Variant(str, Enum):
    FP32 = "fp32"  # the reference
    INT8 = "int8"  # int8 x int8 products (per-channel weights, per-row activation scales: batch-invariant), CPU EP
    INT8_DYNAMIC = "int8-dynamic"  # ORT dynamic quantization: faster on the CPU EP, but a row depends on its batch
    FP16 = "fp16"  # for the CUDA EP

    @property
    def float_dtype(self) -> str:
        return "float16" if self is Variant.FP16 else "float32"


def dims_for(cfg: ModelConfig, float_dtype: str = "float32") -> Dims:
    return Dims(
        n_layers=cfg.n_decoder_layers,
        n_heads=cfg.n_heads,
        head_dim=cfg.head_dim,
        max_len=cfg.max_len,
        vocab_size=cfg.vocab_size,
        float_dtype=float_dtype,
    )


def graph_contracts(cfg: ModelConfig, float_dtype: str = "float32") -> dict[str, GraphContract]:
    """The graphs of a bundle for this config: {"encoder"?, "decoder", "decoder_cpu"?} (see contract.py)."""
    d = dims_for(cfg, float_dtype)
    cross = cfg.arch == Arch.ENCODER_DECODER
    graphs = {"decoder": decoder_contract(d, cross)}
    if cross:
        graphs = {"encoder": encoder_contract(d), **graphs}
    if has_cpu_decoder(d):
        graphs["decoder_cpu"] = decoder_cpu_contract(d, cross)
    return graphs


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class Bundle:
    dir: Path
    manifest: dict[str, Any]
    model_config: dict[str, Any]
    task: str
    variant: Variant
    special_ids: dict[str, int]  # pad, bos, eos, unk
    paths: dict[str, Path]  # graph name ("encoder", "decoder") -> file
    tokenizer_path: Path
    tokenizer_kind: str = "bpe"  # "bpe" (model/tokenizer.py) or "sentencepiece" (model/spm_tokenizer.py)
    banned_ids: tuple[int, ...] = ()  # token ids never generated (an imported Marian model's bad_words_ids)

    @property
    def version(self) -> str:
        """The bundle's content version (`content_version`), checked against the manifest's when it has one."""
        return str(self.manifest["version"])

    @property
    def created(self) -> int:
        """When the bundle was written (Unix seconds): the manifest's `created`, else manifest.json's mtime."""
        created = self.manifest.get("created")
        return int(created) if created is not None else int((self.dir / MANIFEST_FILE).stat().st_mtime)

    @property
    def config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.model_config)

    @property
    def is_encoder_decoder(self) -> bool:
        return "encoder" in self.paths

    @property
    def contracts(self) -> dict[str, dict[str, Any]]:
        return self.manifest["graphs"]

    def load_tokenizer(self) -> Any:
        """The bundle's tokenizer: model.tokenizer.Tokenizer or model.spm_tokenizer.SentencePieceTokenizer."""
        if self.tokenizer_kind == "sentencepiece":
            from model.spm_tokenizer import SentencePieceTokenizer

            return SentencePieceTokenizer(self.dir, self.special_ids)
        from model.tokenizer import Tokenizer

        return Tokenizer.load(self.tokenizer_path)

    def read_graph(self, name: str) -> bytes:
        """The graph's bytes, checked against the manifest hash again (what is hashed is what is loaded)."""
        path = self.paths[name]
        data = path.read_bytes()
        want = self.manifest["files"][path.name]
        if hashlib.sha256(data).hexdigest() != want:
            raise BundleError(
                f"bundle file {path} changed after the bundle was loaded (sha256 differs from "
                f"the manifest's {want[:12]}...); re-export the bundle"
            )
        return data


def content_sha256(doc: dict[str, Any]) -> str:
    """The sha256 over what a bundle serves (task, variant, model config, generation settings and the sha256 of
    every file): what a Serve config pins (`bundle_sha256`). Re-exporting the same weights gives the same hash."""
    served = {k: doc[k] for k in ("task", "variant", "model_config", "files", "generation") if k in doc}
    return hashlib.sha256(json.dumps(served, sort_keys=True).encode()).hexdigest()


def content_version(doc: dict[str, Any]) -> str:
    """A bundle's version: the first 12 hex digits of its `content_sha256`; any change of what it serves gives a
    new one."""
    return content_sha256(doc)[:12]


def write_manifest(bundle_dir: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Hash every file of the bundle into manifest["files"], add its `version` and `created` time, and write
    manifest.json (atomically)."""
    files = {}
    for p in sorted(bundle_dir.iterdir()):
        if p.name == MANIFEST_FILE or p.name.endswith(".tmp"):
            continue
        if not p.is_file():
            raise BundleError(f"bundle {bundle_dir} holds {p.name}, which is not a plain file")
        files[p.name] = sha256_file(p)
    doc = {"format_version": FORMAT_VERSION, **manifest, "files": files}
    doc["version"], doc["created"] = content_version(doc), int(time.time())
    tmp = bundle_dir / (MANIFEST_FILE + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, bundle_dir / MANIFEST_FILE)
    return doc


def _read_manifest(bundle_dir: Path) -> dict[str, Any]:
    if not bundle_dir.is_dir():
        raise BundleError(
            f"bundle directory {bundle_dir} does not exist; export one with "
            f"`kvserve export CHECKPOINT --out {bundle_dir}`"
        )
    path = bundle_dir / MANIFEST_FILE
    if not path.is_file():
        raise BundleError(f"bundle {bundle_dir} has no {MANIFEST_FILE}: missing file {path}")
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BundleError(f"bundle file {path} is not valid JSON: {e}") from e
    version = doc.get("format_version")
    if version != FORMAT_VERSION:
        raise BundleError(
            f"bundle {bundle_dir} has format_version {version!r}; this kvserve reads "
            f"format_version {FORMAT_VERSION}: re-export it with this kvserve"
        )
    for key in ("task", "model_config", "variant", "graphs", "files", "tokenizer"):
        if key not in doc:
            raise BundleError(f"bundle file {path} lacks the key {key!r}")
    return doc


def _verify_files(bundle_dir: Path, files: dict[str, str]) -> None:
    for name, want in files.items():
        p = bundle_dir / name
        if Path(name).name != name:
            raise BundleError(f"bundle manifest lists {name!r}, which is not a file name inside the bundle")
        if not p.is_file():
            raise BundleError(f"bundle {bundle_dir} is incomplete: missing file {name}")
        got = sha256_file(p)
        if got != want:
            raise BundleError(
                f"bundle file {p} was changed: sha256 {got[:12]}... but the manifest says "
                f"{want[:12]}...; restore the file or re-export the bundle"
            )
    unlisted = sorted(p.name for p in bundle_dir.iterdir() if p.name != MANIFEST_FILE and p.name not in files)
    if unlisted:
        raise BundleError(
            f"bundle {bundle_dir} holds files its manifest does not list: {unlisted}; "
            f"remove them or re-export the bundle"
        )


def load_bundle(bundle_dir: str | Path, sha256: str | None = None) -> Bundle:
    """Load and verify a bundle; raises BundleError naming the file at fault. `sha256`: the content hash the
    bundle must have (a Serve config's `bundle_sha256`): a bundle swapped on its volume is refused, even one
    whose manifest vouches for its own files."""
    bundle_dir = Path(bundle_dir)
    doc = _read_manifest(bundle_dir)
    if sha256 is not None and content_sha256(doc) != sha256:
        raise BundleError(
            f"bundle {bundle_dir} is not the one the Serve config pins: its content hashes to "
            f"{content_sha256(doc)}, the config's bundle_sha256 is {sha256}"
        )
    _verify_files(bundle_dir, doc["files"])
    task = doc["task"]
    if task not in TASKS:
        raise BundleError(f"bundle {bundle_dir}: task {task!r} is not one of {TASKS}")
    try:
        variant = Variant(doc["variant"])
        cfg = ModelConfig.from_dict(doc["model_config"])
    except ValueError as e:
        raise BundleError(f"bundle {bundle_dir}/{MANIFEST_FILE}: {e}") from e
    want = {k: c.to_dict() for k, c in graph_contracts(cfg, variant.float_dtype).items()}
    if "decoder_cpu" not in doc["graphs"]:  # bundles exported before decoder_cpu.onnx existed
        want.pop("decoder_cpu", None)
    if doc["graphs"] != want:
        raise BundleError(
            f"bundle {bundle_dir}/{MANIFEST_FILE}: its graph contracts differ from the ones "
            f"export/contract.py derives from its model config (graphs {sorted(want)}); "
            f"re-export the bundle with this kvserve"
        )
    paths = {}
    for name, c in want.items():
        if c["file"] not in doc["files"]:
            raise BundleError(f"bundle {bundle_dir}: graph file {c['file']} is not listed in {MANIFEST_FILE}")
        paths[name] = bundle_dir / c["file"]
    tok = doc["tokenizer"]
    kind = tok.get("kind", "bpe")
    if kind not in TOKENIZER_KINDS:
        raise BundleError(f"bundle {bundle_dir}: tokenizer kind {kind!r} is not one of {TOKENIZER_KINDS}")
    for name in [tok.get("file"), *tok.get("files", [])]:
        if name not in doc["files"]:
            raise BundleError(f"bundle {bundle_dir}: tokenizer file {name!r} is not listed in {MANIFEST_FILE}")
    banned = tuple(int(i) for i in doc.get("generation", {}).get("banned_ids", []))
    if any(not 0 <= i < cfg.vocab_size for i in banned):
        raise BundleError(
            f"bundle {bundle_dir}: generation.banned_ids {list(banned)} must be token ids in [0, {cfg.vocab_size})"
        )
    _check_version(bundle_dir, doc)
    return Bundle(
        dir=bundle_dir,
        manifest=doc,
        model_config=doc["model_config"],
        task=task,
        variant=variant,
        special_ids=dict(tok["special_ids"]),
        paths=paths,
        tokenizer_path=bundle_dir / tok["file"],
        tokenizer_kind=kind,
        banned_ids=banned,
    )


def _check_version(bundle_dir: Path, doc: dict[str, Any]) -> None:
    """Give a manifest without a version (written before versions existed) its version; refuse an edited one."""
    version = content_version(doc)
    if doc.setdefault("version", version) != version:
        raise BundleError(
            f"bundle {bundle_dir}/{MANIFEST_FILE} says version {doc['version']!r}, but its content "
            f"hashes to {version!r}: the manifest was edited; re-export the bundle"
        )


def check_graph_io(
    contract: dict[str, Any], inputs: list[tuple[str, str, list]], outputs: list[tuple[str, str, list]], where: str
) -> None:
    """A graph's (name, dtype, shape) inputs and outputs must equal its contract's, in order.

    A symbolic dimension must stay symbolic (a traced size must not have been baked in); its name may
    differ (an exporter may rename it). Fixed dimensions must be equal.
    """
    for kind, got in (("inputs", inputs), ("outputs", outputs)):
        want = contract[kind]
        if [g[0] for g in got] != [w["name"] for w in want]:
            raise BundleError(
                f"graph {where}: {kind} are {[g[0] for g in got]}, the contract says {[w['name'] for w in want]}"
            )
        for (name, dtype, shape), w in zip(got, want, strict=True):
            fixed_ok = len(shape) == len(w["shape"]) and all(
                (not isinstance(gd, int) or gd <= 0) if isinstance(wd, str) else gd == wd
                for gd, wd in zip(shape, w["shape"], strict=True)
            )
            if dtype != w["dtype"] or not fixed_ok:
                raise BundleError(
                    f"graph {where}: {name} is {dtype}{list(shape)}, the contract says {w['dtype']}{w['shape']}"
                )
