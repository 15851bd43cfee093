#!/usr/bin/env bash
# The control plane's serving certificate without cert-manager: a private CA and a
# certificate for the control plane's Service names (openssl), stored as the Secret
# kvroute/kvroute-controlplane-tls (tls.crt, tls.key and ca.crt, which the proxies trust
# for gRPC), and the CA put into the webhook configuration.
#
#   deploy/kubernetes/webhook-certs.sh              # needs kubectl pointed at the cluster
#   deploy/kubernetes/webhook-certs.sh --out DIR    # only write ca.crt, tls.crt, tls.key
#
# Run it after `kubectl apply -k` (the webhook configuration must exist), and again
# before the certificate expires (DAYS, 365 by default); then restart the control plane
# and the proxies. EXTRA_SANS adds names, e.g. "IP:10.0.0.5,DNS:cp.example".
set -euo pipefail

namespace=kvroute
service=kvroute-controlplane
secret=kvroute-controlplane-tls
webhook=kvroute-sidecar-injector
days=${DAYS:-365}
out=""
if [ "${1:-}" = "--out" ]; then out=${2:?--out needs a directory}; fi

dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
names="DNS:$service,DNS:$service.$namespace,DNS:$service.$namespace.svc,DNS:$service.$namespace.svc.cluster.local"
if [ -n "${EXTRA_SANS:-}" ]; then names="$names,$EXTRA_SANS"; fi

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days "$days" \
  -subj "/CN=kvroute webhook CA" -keyout "$dir/ca.key" -out "$dir/ca.crt" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
  -subj "/CN=$service.$namespace.svc" -keyout "$dir/tls.key" -out "$dir/tls.csr" 2>/dev/null
printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\n' "$names" > "$dir/ext.cnf"
openssl x509 -req -in "$dir/tls.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" -CAcreateserial \
  -days "$days" -extfile "$dir/ext.cnf" -out "$dir/tls.crt" 2>/dev/null

if [ -n "$out" ]; then
  mkdir -p "$out"
  cp "$dir/ca.crt" "$dir/tls.crt" "$dir/tls.key" "$out/"
  exit 0
fi

kubectl -n "$namespace" create secret generic "$secret" --type=kubernetes.io/tls \
  --from-file=tls.crt="$dir/tls.crt" --from-file=tls.key="$dir/tls.key" \
  --from-file=ca.crt="$dir/ca.crt" --dry-run=client -o yaml | kubectl apply -f -
bundle=$(base64 < "$dir/ca.crt" | tr -d '\n')
kubectl patch mutatingwebhookconfiguration "$webhook" --type=json \
  -p "[{\"op\":\"add\",\"path\":\"/webhooks/0/clientConfig/caBundle\",\"value\":\"$bundle\"}]"
echo "webhook-certs: $namespace/$secret written, $webhook trusts its CA for $days days"
