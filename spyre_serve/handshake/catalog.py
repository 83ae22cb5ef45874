"""The warm-start catalog: a card's compiled programs and block reports, shared by the cluster.

On real cards warmup is compilation and takes minutes; every replica an autoscaler adds on a
new node would pay it again. The first replica that finishes its handshake for a key stores
what its cards compiled and what they reported; the next replica with the same key, on any
node, unpacks them before its own warmup, so the compiles hit. The contract does not change: it still warms up on 4 blocks, its cards
still report, the coordinator still takes the minimum of the fresh reports.

What travels for the `cpu` backend is the card's inductor cache directory (one per key), packed
as a tar.gz. PyTorch's own portable mega-cache (`torch.compiler.save_cache_artifacts`) was
measured first and does not help here: on CPU it carries the FX/AOT graphs but not the
compiled C++ kernels, so a fresh node still compiled for 9.8 s of the cold 11.9 s; the packed
directory (150 KiB) brings the first call down to 1.8 s.

The store is a named, detached Ray actor (no shared filesystem needed) with a size cap, or a
directory (`cache_uri`) for clusters that have shared storage. Written here because neither
vLLM nor Ray Serve shares compile results across nodes.
"""
from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import platform
import tarfile
import time
from collections import OrderedDict
from importlib import metadata
from pathlib import Path

from spyre_serve import get_logger
from spyre_serve.vllm_compat import hook

logger = get_logger(__name__)

SCHEMA = 1
ACTOR_NAME, NAMESPACE = "spyre-serve-catalog", "spyre_serve"
MAX_ENTRY_BYTES = 64 * 2**20
MAX_TOTAL_BYTES = 512 * 2**20


# ---- the key: everything that changes what a card compiles or how many blocks it holds ----

def model_fingerprint(model: str) -> str:
    """A content hash of the model's config and weights index (names, dtypes, shapes,
    offsets of every tensor), not its path: a copy elsewhere hashes the same, a changed
    checkpoint does not. Weight values are left out: they change no program and no size."""
    folder = Path(model)
    if not folder.is_dir():
        return "name:" + model
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json"):
        if (folder / name).is_file():
            digest.update(name.encode() + (folder / name).read_bytes())
    for weights in sorted(folder.glob("*.safetensors")):
        with open(weights, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            digest.update(weights.name.encode() + f.read(min(header_len, 100 * 2**20)))
    return digest.hexdigest()[:16]


def compiler_version(backend: str) -> str:
    if backend == "sendnn":
        try:
            return "torch_sendnn " + metadata.version("torch_sendnn")
        except metadata.PackageNotFoundError:
            return "torch_sendnn unknown"
    import torch
    return "torch " + torch.__version__


def key_fields(vllm_config, settings, cards: list) -> dict:
    """`cards`: each rank's card as it knows itself (a simulated card's budget, which its
    node may set; "spyre" for a real one, whose capacity is its compiler's to report)."""
    model_config = vllm_config.model_config
    return {
        "model": model_fingerprint(model_config.model),
        "tensor_parallel_size": len(cards),
        "max_model_len": model_config.max_model_len,
        "max_num_seqs": vllm_config.scheduler_config.max_num_seqs,
        "block_size": vllm_config.cache_config.block_size,
        "dtype": str(model_config.dtype).removeprefix("torch."),
        "backend": settings.backend,
        "compiler": compiler_version(settings.backend),
        "machine": platform.machine(),  # compiled kernels are native code
        "spyre_serve": metadata.version("spyre_serve"),
        "cards": list(cards),
    }


def catalog_key(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


# ---- the compiled programs: one cache directory per key on each node ----

def compile_cache_dir(settings, key: str, node_id: str) -> str:
    """Where this node's card compiler keeps the programs of `key`."""
    from spyre_serve.vllm_plugin.settings import node_scratch
    base = settings.compile_cache_dir or node_scratch("compile-cache")
    return os.path.join(base.replace("{node_id}", node_id), key)


def pack_dir(path: str) -> bytes | None:
    if not os.path.isdir(path):
        return None
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(path, arcname=".", filter=lambda info: None if "/locks" in info.name else info)
    return buffer.getvalue()


def unpack_into(data: bytes, path: str) -> None:
    os.makedirs(path, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        tar.extractall(path, filter="data")  # no absolute paths, links out, or devices


# ---- an entry: the key's fields, the handshake's result, each rank's compile artifacts ----

def make_entry(key: str, fields: dict, reports: list[dict], artifacts: list[bytes | None],
               num_blocks: int | None = None) -> dict:
    """The handshake's result (every rank's report, the block count chosen) and what each
    rank compiled."""
    return {"schema": SCHEMA, "key": key, "fields": fields, "created_at": time.time(),
            "num_blocks": num_blocks,
            "reports": [{k: r[k] for k in ("rank", "num_blocks", "bytes_per_block")}
                        for r in reports],
            "artifacts": [base64.b64encode(a).decode() if a else None for a in artifacts]}


def entry_problem(entry, key: str, world_size: int) -> str | None:
    """Why an entry cannot be used for `key`, or None. Anything odd is a reason to start cold."""
    if not isinstance(entry, dict):
        return f"it is a {type(entry).__name__}, not an entry"
    if entry.get("schema") != SCHEMA or entry.get("key") != key:
        return f"schema {entry.get('schema')!r} / key {entry.get('key')!r} do not match"
    reports, artifacts = entry.get("reports"), entry.get("artifacts")
    if not isinstance(reports, list) or len(reports) != world_size or \
            not isinstance(artifacts, list) or len(artifacts) != world_size:
        return f"it holds {len(reports or [])} reports and {len(artifacts or [])} artifact " \
               f"sets for {world_size} ranks (a partial entry)"
    for a in artifacts:
        if a is not None:
            try:
                base64.b64decode(a, validate=True)
            except (ValueError, TypeError):
                return "its compile artifacts are not valid base64"
    return None


def artifacts_of(entry: dict) -> list[bytes | None]:
    return [base64.b64decode(a) if a else None for a in entry["artifacts"]]


def reports_disagree(entry: dict, reports: list[dict]) -> list[str]:
    """Ranks whose fresh report differs from the catalog's (a changed compiler or card)."""
    stored = {r["rank"]: r for r in entry["reports"]}
    return [f"rank {r['rank']}: catalog {stored.get(r['rank'], {}).get('num_blocks')} blocks, "
            f"fresh {r['num_blocks']}" for r in reports
            if stored.get(r["rank"], {}).get("num_blocks") != r["num_blocks"]
            or stored.get(r["rank"], {}).get("bytes_per_block") != r["bytes_per_block"]]


def entry_bytes(entry: dict) -> int:
    return len(json.dumps(entry))


# ---- stores ----

class MemoryStore:
    """Entries in memory, least recently used evicted past `max_total_bytes`. What the
    catalog actor holds; pure, so its caps are unit tested."""

    def __init__(self, max_entry_bytes: int = MAX_ENTRY_BYTES,
                 max_total_bytes: int = MAX_TOTAL_BYTES):
        self.max_entry_bytes, self.max_total_bytes = max_entry_bytes, max_total_bytes
        self.entries: OrderedDict[str, tuple[dict, int]] = OrderedDict()

    def get(self, key: str):
        if key not in self.entries:
            return None
        self.entries.move_to_end(key)
        return self.entries[key][0]

    def put(self, key: str, entry: dict) -> str:
        size = entry_bytes(entry)
        if size > self.max_entry_bytes:
            return f"refused: {size} bytes exceed the {self.max_entry_bytes}-byte entry cap"
        self.entries.pop(key, None)
        self.entries[key] = (entry, size)
        evicted = []
        while sum(s for _, s in self.entries.values()) > self.max_total_bytes:
            evicted.append(self.entries.popitem(last=False)[0])
        return f"stored ({size} bytes)" + (f"; evicted {', '.join(evicted)}" if evicted else "")

    def sizes(self) -> dict[str, int]:
        return {k: s for k, (_, s) in self.entries.items()}


class DirectoryStore:
    """Entries as files under `cache_uri` (shared storage: NFS, a PVC), one per key."""

    def __init__(self, root: str, max_entry_bytes: int = MAX_ENTRY_BYTES):
        self.root, self.max_entry_bytes = Path(root), max_entry_bytes

    def path(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def get(self, key: str):
        path = self.path(key)
        if not path.exists():
            return None
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as e:
            return f"unreadable ({type(e).__name__}: {e})"

    def put(self, key: str, entry: dict) -> str:
        data = json.dumps(entry)
        if len(data) > self.max_entry_bytes:
            return f"refused: {len(data)} bytes exceed the {self.max_entry_bytes}-byte entry cap"
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.path(key).with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(data)
        os.replace(tmp, self.path(key))  # readers never see half an entry
        return f"stored ({len(data)} bytes) in {self.path(key)}"


_CATALOG_CLASS = None


def _catalog_actor():
    """The cluster's catalog: one named, detached actor, created by the first replica."""
    global _CATALOG_CLASS
    import ray
    if _CATALOG_CLASS is None:  # one remote class per process, not one per call
        @ray.remote(num_cpus=0, max_restarts=-1)
        class Catalog(MemoryStore):
            pass

        _CATALOG_CLASS = Catalog
    # On the head node, which the autoscaler never removes: on a worker node the catalog
    # would die (and restart empty) with the first idle node scaled down, and its being
    # there would keep that node from counting as idle.
    head = hook("ray._common.constants:HEAD_NODE_RESOURCE_NAME")
    # Not in the caller's placement group either (a Serve replica's children default to it).
    return _CATALOG_CLASS.options(name=ACTOR_NAME, namespace=NAMESPACE, lifetime="detached",
                                  get_if_exists=True, resources={head: 0.001},
                                  scheduling_strategy="DEFAULT").remote()


def end_catalog() -> bool:
    """Before the cluster's head stops: end the catalog actor (its entries end with the
    cluster anyway). Being detached, it outlives Serve's shutdown and holds a worker on the
    head; Ray 2.60's `ray start --block` drains its node on SIGTERM until no worker is left
    or RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S (30 s) passes, so every stop waited those
    30 s. Needs a connected driver; False if there was no catalog actor."""
    import ray
    try:
        actor = ray.get_actor(ACTOR_NAME, namespace=NAMESPACE)
    except ValueError:
        return False
    ray.kill(actor, no_restart=True)
    return True


def start_catalog_ahead(settings) -> None:
    """In the Serve replica, before its engine: ask for the cluster's catalog actor now, so
    the handshake does not wait for its process to start (once per cluster)."""
    if settings.warm_start and not settings.cache_uri:
        _catalog_actor()


class CatalogClient:
    """What the executor uses: fetch a usable entry (or None, saying why) and store one."""

    def __init__(self, cache_uri: str = ""):
        self.where = cache_uri or f"Ray actor {NAMESPACE}/{ACTOR_NAME}"
        self.store = DirectoryStore(cache_uri) if cache_uri else None

    def _call(self, method: str, *args):
        if self.store is not None:
            return getattr(self.store, method)(*args)
        import ray
        return ray.get(getattr(_catalog_actor(), method).remote(*args), timeout=60)

    def fetch(self, key: str, world_size: int) -> dict | None:
        try:
            entry = self._call("get", key)
        except Exception as e:  # noqa: BLE001 - a catalog that fails means a cold start
            logger.warning("warm-start catalog (%s) could not be read: %s; starting cold",
                           self.where, e)
            return None
        if entry is None:
            return None
        problem = entry_problem(entry, key, world_size)
        if problem:
            logger.warning("warm-start catalog entry %s in %s is ignored: %s; starting cold",
                           key, self.where, problem)
            return None
        return entry

    def save(self, key: str, entry: dict) -> None:
        try:
            outcome = self._call("put", key, entry)
        except Exception as e:  # noqa: BLE001 - a replica serves whether or not it is stored
            outcome = f"failed: {e}"
        logger.info("warm-start catalog entry %s (%s): %s", key, self.where, outcome)


def start_state(key: str, starts: list[str]) -> str:
    """How a replica's cards started: every compile from the catalog, from this node's own
    cache (nothing compiled, nothing fetched), or cold (something was compiled)."""
    if starts and all(s == "warm" for s in starts):
        return f"warm (catalog {key})"
    if starts and all(s in ("warm", "local") for s in starts):
        return "warm (local cache)"
    return "cold"


class WarmStart:
    """The catalog's part in one handshake: the entry for this engine's key before warmup,
    the fresh result stored after the decision (when missing or when the reports differ)."""

    def __init__(self, vllm_config, settings, world_size: int, cards):
        """`cards()` asks each rank what its card is (only when the catalog is on)."""
        self.world_size = world_size
        self.key, self.fields, self.client, self.entry = "", {}, None, None
        if settings.warm_start:
            self.fields = key_fields(vllm_config, settings, cards())
            self.key = catalog_key(self.fields)
            self.client = CatalogClient(settings.cache_uri)
            self.entry = self.client.fetch(self.key, world_size)

    def artifacts(self) -> list[bytes | None] | None:
        return artifacts_of(self.entry) if self.entry else None

    def record(self, reports: list[dict], num_blocks: int, gather_artifacts) -> dict:
        """Store the result if the catalog lacks it or disagrees; return the status part."""
        replaced = reports_disagree(self.entry, reports) if self.entry else []
        if replaced:
            logger.warning("warm-start catalog entry %s disagrees with this replica's fresh "
                           "reports (%s): trusting the fresh reports and replacing it",
                           self.key, "; ".join(replaced))
        if self.client is not None and (self.entry is None or replaced):
            self.client.save(self.key, make_entry(self.key, self.fields, reports,
                                                  gather_artifacts(), num_blocks))
        return {"key": self.key, "fields": self.fields, "replaced": replaced,
                "catalog": self.client.where if self.client else None,
                "state": start_state(self.key, [r.get("start", "cold") for r in reports])}
