#!/usr/bin/env python3
"""Offline validation of the Kubernetes manifests in deploy/.

Core kinds (Deployment, Service, PersistentVolumeClaim, ...) are checked with the
kubernetes-validate package's bundled, strict OpenAPI schemas for a pinned Kubernetes
version. Custom resources (InferencePool, HTTPRoute, Gateway) are checked against the
OpenAPI v3 schemas of their CRDs, committed under deploy/schemas/, made strict here: an
object schema that lists its properties allows no others unless the CRD says
`x-kubernetes-preserve-unknown-fields` (the API server would silently prune such a field;
here it is an error, since a misspelt field is a bug in the manifest). CEL rules
(`x-kubernetes-validations`) are left to the API server. Then a few cross-checks between the
manifests: the InferencePool selects the Deployment's pods on a port they serve, the
HTTPRoute points at objects that exist, the grace period covers flint's shutdown grace,
and kustomization.yaml lists every manifest.

Nothing here touches the network: the schemas are local files.

  validate_deploy.py [--dir deploy] [--kube-version 1.35.0 ...]   validate; exit 1 on any error
  validate_deploy.py --self-test        break copies of deploy/ on purpose; each must fail
  validate_deploy.py --extract-crd CRD.yaml --version v1 --source URL --out FILE
                                        write one served version's schema of an upstream CRD
"""

import argparse
import copy
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_KUBE_VERSIONS = ["1.35.0"]
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"


# ---------------------------------------------------------------- CRD schema extraction


def strip_descriptions(node):
    """Drop prose from a schema (it is most of a CRD's bytes); keep every constraint."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k == "description":
                continue
            if k == "properties" and isinstance(v, dict):
                out[k] = {name: strip_descriptions(s) for name, s in v.items()}
            else:
                out[k] = strip_descriptions(v)
        return out
    if isinstance(node, list):
        return [strip_descriptions(x) for x in node]
    return node


def extract_crd(crd_path, version, source, out_path):
    crd = yaml.safe_load(Path(crd_path).read_text())
    if crd.get("kind") != "CustomResourceDefinition":
        sys.exit(f"{crd_path}: not a CustomResourceDefinition")
    spec = crd["spec"]
    found = [v for v in spec["versions"] if v["name"] == version]
    if not found:
        sys.exit(f"{crd_path}: no version {version}")
    v = found[0]
    if not v.get("served"):
        sys.exit(f"{crd_path}: version {version} is not served")
    doc = {
        "source": source,
        "crd": crd["metadata"]["name"],
        "annotations": {
            k: val for k, val in (crd["metadata"].get("annotations") or {}).items() if "version" in k or "channel" in k
        },
        "group": spec["group"],
        "version": version,
        "kind": spec["names"]["kind"],
        "note": "description fields removed; every other keyword as in the upstream CRD",
        "openAPIV3Schema": strip_descriptions(v["schema"]["openAPIV3Schema"]),
    }
    Path(out_path).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out_path}: {doc['group']}/{version} {doc['kind']}")


# ---------------------------------------------------------------- strict CRD validation


def strictify(node):
    """A structural CRD schema turned into a strict JSON Schema (draft 2020-12)."""
    if isinstance(node, list):
        return [strictify(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k == "properties":
            out[k] = {name: strictify(s) for name, s in v.items()}
        elif k == "items" or (k == "additionalProperties" and isinstance(v, dict)):
            out[k] = strictify(v)
        else:
            # Values (default, enum, CEL rules, ...) as they are, and so the branches of
            # allOf/anyOf/oneOf/not: in a structural schema they only restate the outer schema's
            # fields, so closing a branch to "no other properties" would be wrong.
            out[k] = v
    if out.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    if out.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    preserve = out.get("x-kubernetes-preserve-unknown-fields") is True
    is_object = out.get("type") == "object" or "properties" in out
    if is_object and not preserve and "additionalProperties" not in out:
        # The API server prunes unknown fields of such an object: for a manifest that is a typo.
        out["additionalProperties"] = False
    return out


class Schemas:
    """Every schema the validator knows: kubernetes-validate's for core kinds, deploy/schemas/ for CRDs."""

    def __init__(self, schema_dir):
        import jsonschema  # noqa: F401  (imported here so --extract-crd needs only yaml)
        import kubernetes_validate  # noqa: F401

        self.crds = {}
        for f in sorted(Path(schema_dir).glob("*.json")):
            d = json.loads(f.read_text())
            self.crds[(f"{d['group']}/{d['version']}", d["kind"])] = (f, d)
        self._validators = {}

    def k8s_definitions(self, kube_version):
        import importlib.resources

        base = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema"
        mm = ".".join(kube_version.split(".")[:2])
        cands = [p for p in base.iterdir() if p.name.startswith(f"v{mm}.") and p.name.endswith("-local-strict")]
        if not cands:
            raise SystemExit(f"FATAL kubernetes-validate has no schemas for Kubernetes {kube_version}")
        return json.loads((sorted(cands, key=lambda p: p.name)[-1] / "_definitions.json").read_text())

    def crd_validator(self, key, kube_version):
        import jsonschema
        from referencing import Registry, Resource

        vkey = (key, kube_version)
        if vkey in self._validators:
            return self._validators[vkey]
        _, d = self.crds[key]
        schema = strictify(copy.deepcopy(d["openAPIV3Schema"]))
        defs = self.k8s_definitions(kube_version)
        # The CRD leaves metadata as a bare object; check it as the API server does (ObjectMeta).
        schema["properties"]["metadata"] = {"$ref": f"{defs['$id']}#/$defs/{OBJECT_META}"}
        schema["properties"]["apiVersion"] = {"const": key[0]}
        schema["properties"]["kind"] = {"const": key[1]}
        schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata"})
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        registry = Resource.from_contents(defs) @ Registry()
        v = jsonschema.Draft202012Validator(schema, registry=registry)
        self._validators[vkey] = v
        return v


def field_path(path):
    s = ""
    for p in path:
        s += f"[{p}]" if isinstance(p, int) else (f".{p}" if s else str(p))
    return s or "(top level)"


def validate_doc(schemas, doc, kube_version):
    """(error line without the file prefix, checked against kube_version's schema) for one document."""
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError, ValidationError

    if not isinstance(doc, dict) or "apiVersion" not in doc or "kind" not in doc:
        return [("(top level): not a Kubernetes object (apiVersion and kind are required)", False)]
    key = (doc["apiVersion"], doc["kind"])
    if key in schemas.crds:
        v = schemas.crd_validator(key, kube_version)
        errs = sorted(v.iter_errors(doc), key=lambda e: (list(map(str, e.absolute_path)), e.message))
        return [(f"{field_path(e.absolute_path)}: {e.message}", False) for e in errs]
    same_kind = sorted(k[0] for k in schemas.crds if k[1] == doc["kind"])
    if same_kind:
        msg = f"apiVersion: {doc['apiVersion']} is not one this repository targets for {doc['kind']} ({', '.join(same_kind)})"
        return [(msg, False)]
    try:
        kubernetes_validate.validate(doc, kube_version, strict=True)
    except ValidationError as e:
        return [(f"{field_path(e.path)}: {e.message}", True)]
    except SchemaNotFoundError:
        return [(f"apiVersion/kind: no schema for {doc['kind']} {doc['apiVersion']}; a custom resource needs its CRD schema in deploy/schemas/", True)]
    return []


# ---------------------------------------------------------------- cross-checks


def dig(d, *keys, default=None):
    """d[k1][k2]... or default where a level is missing or not a mapping (a broken manifest)."""
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


def by_kind(docs, kind):
    return [(f, d) for f, d in docs if isinstance(d, dict) and d.get("kind") == kind]


def name_of(d):
    return (d.get("metadata") or {}).get("name", "?")


def arg_value(args, flag, default=None):
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return default


def cross_checks(docs, deploy_dir, files):
    """(file, kind/name, message) for manifests that are each valid but do not fit together."""
    errs = []
    deployments = by_kind(docs, "Deployment")
    for f, pool in by_kind(docs, "InferencePool"):
        spec = pool.get("spec") or {}
        want = (spec.get("selector") or {}).get("matchLabels") or {}
        ports = {p.get("number") for p in spec.get("targetPorts") or []}
        chosen = [
            d
            for _, d in deployments
            if want and all((dig(d, "spec", "template", "metadata", "labels") or {}).get(k) == v for k, v in want.items())
        ]
        where = f"InferencePool/{name_of(pool)}"
        if not chosen:
            errs.append((f, where, f"spec.selector.matchLabels {want} selects the pods of no Deployment in {deploy_dir}"))
        for d in chosen:
            served = {
                p.get("containerPort")
                for c in dig(d, "spec", "template", "spec", "containers", default=[])
                for p in c.get("ports") or []
            }
            for p in sorted(ports - served, key=str):
                errs.append((f, where, f"spec.targetPorts: {p!r} is not a containerPort of Deployment/{name_of(d)}"))
        epp = (spec.get("endpointPickerRef") or {}).get("name")
        if epp is not None and epp != f"{name_of(pool)}-epp":
            errs.append(
                (
                    f,
                    where,
                    f"spec.endpointPickerRef.name: {epp!r}; the upstream inferencepool chart names the EPP "
                    f"Service <release>-epp, so a pool named {name_of(pool)!r} expects {name_of(pool) + '-epp'!r}",
                )
            )
    pools = {name_of(d) for _, d in by_kind(docs, "InferencePool")}
    gateways = {name_of(d) for _, d in by_kind(docs, "Gateway")}
    for f, route in by_kind(docs, "HTTPRoute"):
        where = f"HTTPRoute/{name_of(route)}"
        for i, pr in enumerate((route.get("spec") or {}).get("parentRefs") or []):
            if pr.get("kind", "Gateway") == "Gateway" and gateways and pr.get("name") not in gateways:
                errs.append((f, where, f"spec.parentRefs[{i}].name: no Gateway {pr.get('name')!r} in {deploy_dir}"))
        for ri, rule in enumerate((route.get("spec") or {}).get("rules") or []):
            for bi, br in enumerate(rule.get("backendRefs") or []):
                if br.get("kind") == "InferencePool" and br.get("name") not in pools:
                    errs.append(
                        (f, where, f"spec.rules[{ri}].backendRefs[{bi}].name: no InferencePool {br.get('name')!r} in {deploy_dir}")
                    )
    for f, d in deployments:
        where = f"Deployment/{name_of(d)}"
        pod = dig(d, "spec", "template", "spec", default={})
        for c in pod.get("containers") or []:
            if "flint" not in " ".join(c.get("command") or []) + " " + c.get("image", ""):
                continue
            args = (c.get("command") or []) + (c.get("args") or [])
            port = arg_value(args, "--port", "8000")
            cports = {str(p.get("containerPort")) for p in c.get("ports") or []}
            if port not in cports:
                errs.append((f, where, f"containers[{c.get('name')}]: flint --port {port} is not among containerPorts {sorted(cports)}"))
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                path = ((c.get(probe) or {}).get("httpGet") or {}).get("path")
                if path != "/health":
                    errs.append((f, where, f"containers[{c.get('name')}].{probe}.httpGet.path: {path!r}, flint's health route is '/health'"))
            grace = int(arg_value(args, "--shutdown-grace", "30"))
            pre = ((((c.get("lifecycle") or {}).get("preStop") or {}).get("sleep") or {}).get("seconds")) or 0
            total = pod.get("terminationGracePeriodSeconds", 30)
            if total < grace + pre:
                errs.append(
                    (
                        f,
                        where,
                        f"spec.template.spec.terminationGracePeriodSeconds: {total} < preStop sleep {pre} + flint --shutdown-grace {grace}",
                    )
                )
    kfile = deploy_dir / "kustomization.yaml"
    if kfile.exists():
        k = yaml.safe_load(kfile.read_text()) or {}
        listed = set(k.get("resources") or [])
        for r in sorted(listed - set(files)):
            errs.append((kfile, "Kustomization", f"resources: {r!r} is not a manifest in {deploy_dir}"))
        for r in sorted(set(files) - listed):
            errs.append((kfile, "Kustomization", f"resources: {r!r} is missing (every manifest in {deploy_dir} belongs in it)"))
    return errs


# ---------------------------------------------------------------- driver


def manifest_files(deploy_dir):
    return sorted(p.name for p in deploy_dir.glob("*.yaml") if p.name != "kustomization.yaml")


def rel(p):
    p = Path(p).resolve()
    try:
        return str(p.relative_to(ROOT))
    except ValueError:
        return str(p)


def validate_dir(deploy_dir, kube_versions, schema_dir):
    deploy_dir = Path(deploy_dir)
    schemas = Schemas(schema_dir)
    files = manifest_files(deploy_dir)
    if not files:
        print(f"ERROR {rel(deploy_dir)}: no manifests")
        return 1
    docs, bad, count = [], 0, 0
    for name in files:
        path = deploy_dir / name
        try:
            loaded = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        except yaml.YAMLError as e:
            print(f"ERROR {rel(path)}: YAML: {str(e).splitlines()[0]}")
            bad += 1
            continue
        for d in loaded:
            docs.append((path, d))
            kind = f"{d.get('kind', '?')}/{name_of(d)}" if isinstance(d, dict) else "?"
            seen = {}  # the same error under several Kubernetes versions is one line
            for kv in kube_versions:
                for line, core in validate_doc(schemas, d, kv):
                    seen.setdefault((line, core), []).append(kv)
            for (line, core), kvs in seen.items():
                suffix = f" (Kubernetes {', '.join(kvs)})" if core else ""
                print(f"ERROR {rel(path)}: {kind}: {line}{suffix}")
                bad += 1
            count += 1
    try:
        crossed = cross_checks(docs, deploy_dir, files)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        if not bad:
            raise
        crossed = []  # a manifest too broken to compare with the others; its errors are above
        print(f"NOTE cross-checks skipped ({type(e).__name__}: {e})")
    for f, where, msg in crossed:
        print(f"ERROR {rel(f)}: {where}: {msg}")
        bad += 1
    if bad:
        print(f"FAILED: {bad} error(s) in {count} object(s) under {rel(deploy_dir)}")
        return 1
    kinds = ", ".join(sorted({d.get("kind") for _, d in docs}))
    print(
        f"OK: {count} objects in {len(files)} files under {rel(deploy_dir)} ({kinds}); "
        f"core kinds against Kubernetes {', '.join(kube_versions)} (strict), CRDs against {rel(schema_dir)} (strict)"
    )
    return 0


# ---------------------------------------------------------------- self-test


def _find(docs, kind):
    for d in docs:
        if d.get("kind") == kind:
            return d
    raise SystemExit(f"self-test: no {kind} in deploy/")


def _flint_container(docs):
    return _find(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def _rename(d, old, new):
    d[new] = d.pop(old)


BROKEN = [
    # (name, what the error line must mention, mutation of {file: [docs]})
    (
        "Deployment: misspelt field spec.replica",
        "replica",
        lambda m: _rename(_find(m["flint-deployment.yaml"], "Deployment")["spec"], "replicas", "replica"),
    ),
    (
        "Deployment: containerPort as a string",
        "containerPort",
        lambda m: _flint_container(m["flint-deployment.yaml"])["ports"][0].__setitem__("containerPort", "8000"),
    ),
    (
        "Service: unknown field spec.port",
        "port",
        lambda m: _find(m["flint-deployment.yaml"], "Service")["spec"].__setitem__("port", 8000),
    ),
    (
        "InferencePool: misspelt field endpointPickerRef.failurMode",
        "failurMode",
        lambda m: _rename(_find(m["inferencepool.yaml"], "InferencePool")["spec"]["endpointPickerRef"], "failureMode", "failurMode"),
    ),
    (
        "InferencePool: targetPorts[0].number as a string",
        "targetPorts[0].number",
        lambda m: _find(m["inferencepool.yaml"], "InferencePool")["spec"]["targetPorts"][0].__setitem__("number", "8000"),
    ),
    (
        "InferencePool: appProtocol outside its enum",
        "appProtocol",
        lambda m: _find(m["inferencepool.yaml"], "InferencePool")["spec"].__setitem__("appProtocol", "grpc"),
    ),
    (
        "InferencePool: required spec.selector missing",
        "selector",
        lambda m: _find(m["inferencepool.yaml"], "InferencePool")["spec"].pop("selector"),
    ),
    (
        "InferencePool: the old alpha API group",
        "InferencePool",
        lambda m: _find(m["inferencepool.yaml"], "InferencePool").__setitem__(
            "apiVersion", "inference.networking.x-k8s.io/v1alpha2"
        ),
    ),
    (
        "InferencePool: misspelt metadata.label",
        "label",
        lambda m: _rename(_find(m["inferencepool.yaml"], "InferencePool")["metadata"], "labels", "label"),
    ),
    (
        "InferencePool: selector that matches no flint pod",
        "matchLabels",
        lambda m: _find(m["inferencepool.yaml"], "InferencePool")["spec"]["selector"].__setitem__(
            "matchLabels", {"app": "vllm"}
        ),
    ),
    (
        "HTTPRoute: backendRef with 'nam' for 'name'",
        "'nam' was unexpected",
        lambda m: _rename(_find(m["httproute.yaml"], "HTTPRoute")["spec"]["rules"][0]["backendRefs"][0], "name", "nam"),
    ),
    (
        "Deployment: grace period shorter than flint's shutdown grace",
        "terminationGracePeriodSeconds",
        lambda m: _find(m["flint-deployment.yaml"], "Deployment")["spec"]["template"]["spec"].__setitem__(
            "terminationGracePeriodSeconds", 10
        ),
    ),
]


def self_test(deploy_dir, kube_versions, schema_dir):
    """Each broken copy of deploy/ must make the validator exit non-zero and name the field."""
    deploy_dir = Path(deploy_dir)
    files = manifest_files(deploy_dir)
    original = {f: [d for d in yaml.safe_load_all((deploy_dir / f).read_text()) if d is not None] for f in files}
    extra = ["kustomization.yaml"] if (deploy_dir / "kustomization.yaml").exists() else []

    def run(manifests):
        with tempfile.TemporaryDirectory(prefix="flint-deploy-selftest-") as tmp:
            for f, docs in manifests.items():
                Path(tmp, f).write_text(yaml.safe_dump_all(docs, sort_keys=False))
            for f in extra:
                Path(tmp, f).write_text((deploy_dir / f).read_text())
            cmd = [sys.executable, __file__, "--dir", tmp, "--schemas", str(schema_dir)]
            for kv in kube_versions:
                cmd += ["--kube-version", kv]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            return p.returncode, p.stdout + p.stderr

    failures = 0
    rc, out = run(copy.deepcopy(original))
    if rc != 0:
        print(f"self-test: FAIL: an unmodified copy of {rel(deploy_dir)} did not pass:\n{out}")
        return 1
    print(f"self-test: unmodified copy passes")
    for name, needle, mutate in BROKEN:
        m = copy.deepcopy(original)
        mutate(m)
        rc, out = run(m)
        errors = [l for l in out.splitlines() if l.startswith("ERROR ")]
        hit = [l for l in errors if needle in l]
        if rc == 1 and hit:
            print(f"self-test: rejected as expected ({name}): {hit[0][6:].split(': ', 1)[1]}")
        else:
            failures += 1
            print(f"self-test: FAIL ({name}): exit {rc}, no ERROR line mentions {needle!r}:\n{out}")
    if failures:
        print(f"self-test: {failures} broken variant(s) were not caught")
        return 1
    print(f"self-test: OK, all {len(BROKEN)} broken variants rejected")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=str(ROOT / "deploy"), help="directory of manifests (default: deploy/)")
    ap.add_argument("--schemas", default=None, help="CRD schemas (default: deploy/schemas/ of this repository)")
    ap.add_argument("--kube-version", action="append", help=f"Kubernetes version(s) (default: {DEFAULT_KUBE_VERSIONS})")
    ap.add_argument("--self-test", action="store_true", help="check that broken copies of the manifests fail")
    ap.add_argument("--extract-crd", metavar="CRD_YAML", help="extract a CRD's schema (see --version, --source, --out)")
    ap.add_argument("--version", help="with --extract-crd: the CRD version, e.g. v1")
    ap.add_argument("--source", help="with --extract-crd: where the CRD came from (URL at a tag)")
    ap.add_argument("--out", help="with --extract-crd: output JSON file")
    a = ap.parse_args()
    if a.extract_crd:
        if not (a.version and a.source and a.out):
            ap.error("--extract-crd needs --version, --source and --out")
        extract_crd(a.extract_crd, a.version, a.source, a.out)
        return 0
    schema_dir = Path(a.schemas) if a.schemas else ROOT / "deploy" / "schemas"
    kube_versions = a.kube_version or DEFAULT_KUBE_VERSIONS
    if a.self_test:
        return self_test(Path(a.dir), kube_versions, schema_dir)
    return validate_dir(Path(a.dir), kube_versions, schema_dir)


if __name__ == "__main__":
    sys.exit(main())
