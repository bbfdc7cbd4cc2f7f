# multireg — build, test and demo targets. `make test` is what CI runs.

GO       ?= go
VERSION  ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo devel)
COMMIT   ?= $(shell git rev-parse --short HEAD 2>/dev/null || echo unknown)
FUZZTIME ?= 20s
# Prometheus's promtool, which checks and unit-tests the alerts: built from source once per
# release and Go toolchain (e2e/monitoring/build-promtool.sh), then cached here.
PROMTOOL ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/multireg/promtool/promtool
# KUBE=1.35 runs the demo against kubelet 1.35's plugin manager instead of 1.36's.
KUBE     ?= 1.36
MODFILE  := $(if $(filter 1.35,$(KUBE)),-modfile=kube135/go.mod,)

.PHONY: all build demo test unit fuzz vet fmt-check e2e manifests e2e-node bench promtool monitoring

all: build

## build: the multireg binary in bin/, static and stamped with the version.
## (the very command the Dockerfile's build stage runs: hack/build-binary.sh)
build:
	VERSION=$(VERSION) COMMIT=$(COMMIT) GO=$(GO) hack/build-binary.sh bin/multireg

## demo: multireg registering three drivers with kubelet's real plugin manager, one after a failure.
demo: build
	cd e2e && $(GO) run $(MODFILE) ./cmd/demo -multireg ../bin/multireg -config ../examples/local/config.yaml

## test: everything CI runs: formatting, vet, unit tests with the race detector, a fuzz smoke
## run, the image's build command, the end-to-end tests against kubelet 1.36 and 1.35, and the
## shipped manifests and Helm chart, and the single-node Kubernetes test (as root).
test: fmt-check vet unit fuzz build e2e manifests e2e-node

fmt-check:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi

vet:
	$(GO) vet ./...

unit:
	$(GO) test -race -count=1 ./...

## fuzz: run the config parser's fuzz target for FUZZTIME (default 20s).
fuzz:
	$(GO) test ./config -run '^$$' -fuzz '^FuzzParse$$' -fuzztime $(FUZZTIME)

## e2e: the built binary against the real kubelet plugin manager, kubelet 1.36 and 1.35. (go test
## runs vet's checks on the packages it tests; `make -C e2e vet` runs the full vet of both builds.)
e2e:
	$(MAKE) -C e2e test

## manifests: examples/ and the Helm chart decode strictly into their Kubernetes types, their
## multireg configs validate, and their paths agree with the DaemonSet's mounts.
## (With promtool: `promtool check rules` and `promtool test rules` on the alerts, strict decoding
## of the monitoring objects into the Prometheus Operator's types: see `monitoring`.)
manifests: promtool
	PROMTOOL=$(PROMTOOL) $(MAKE) -C e2e/manifests fmt vet tidy-check test

## promtool: Prometheus's promtool at $(PROMTOOL) (about 3.5 min cold on 2 cores, then cached).
promtool:
	e2e/monitoring/build-promtool.sh $(dir $(PROMTOOL)) >/dev/null

## monitoring: the alerts, the chart's and examples' monitoring objects, and the dashboard, alone
## and verbose (`make test` runs them too): promtool's unit tests of every alert, strict decoding
## into the Operator's types, and every metric the dashboard names in a live /metrics.
monitoring: promtool
	cd e2e/manifests && PROMTOOL=$(PROMTOOL) $(GO) test -count=1 -v -run '^(TestPrometheusRules|TestPromtoolCatchesBrokenRules|TestMonitoring.*|TestDashboardQueriesParse)$$' .
	cd e2e && $(GO) test -race -count=1 -v -run '^(TestDashboardMetricsExist|TestMetricNames)$$' ./registration

## e2e-node: a real single-node Kubernetes built from source (kubelet, API server, controller
## manager, scheduler; etcd and containerd from Debian) with bin/multireg on the host and as the
## shipped DaemonSet: CSINode, device capacity, DRA, a kubelet restart, ConfigMap edits, a
## rollout restart. On Kubernetes 1.37 then 1.35 (`KUBE=1.35` for one: see e2e/node/Makefile).
## Needs root; installs its Debian packages; caches each release's binaries.
e2e-node: build
	$(MAKE) -C e2e/node fmt tidy-check test MULTIREG=$(CURDIR)/bin/multireg

## bench: bin/multireg against kubelet's real plugin manager, beside the sidecar baseline, into
## BENCHMARKS.md (about 25 min; not part of test).
bench: build
	MULTIREG_BIN=$(CURDIR)/bin/multireg $(MAKE) -C e2e bench
