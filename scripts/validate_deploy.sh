#!/usr/bin/env bash
# Validates the Kubernetes manifests in deploy/ offline (docs/scale-out.md, "What CI checks"):
# core kinds against kubernetes-validate's bundled schemas for the pinned Kubernetes version(s),
# InferencePool/HTTPRoute/Gateway against the CRD schemas committed in deploy/schemas/, strictly
# (unknown fields are errors), plus cross-checks between the manifests. Then a self-test: broken
# copies of the manifests must each be rejected. The venv under target/ is made on first use;
# after that nothing is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=target/deploy-venv
req=scripts/requirements-deploy.txt
stamp="$venv/.requirements-deploy.sha256"
want=$(sha256sum "$req" | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-input -r "$req"
  echo "$want" >"$stamp"
fi

# Kubernetes 1.35 (the API, k8s.io/api v0.35, that the inference extension v1.5.0 builds
# against) and 1.33, two minors older, so a field too new for an older cluster shows up.
kube=(--kube-version "${KUBE_VERSION_OLDEST:-1.33.0}" --kube-version "${KUBE_VERSION:-1.35.0}")

"$venv/bin/python" scripts/validate_deploy.py --dir deploy "${kube[@]}"
"$venv/bin/python" scripts/validate_deploy.py --dir deploy --self-test "${kube[@]}"
