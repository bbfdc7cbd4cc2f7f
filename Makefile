# multireg — build, test and demo targets. `make test` is what CI runs.

GO       ?= go
VERSION  ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo devel)
COMMIT   ?= $(shell git rev-parse --short HEAD 2>/dev/null || echo unknown)
LDFLAGS  := -s -w -X main.version=$(VERSION) -X main.commit=$(COMMIT)
FUZZTIME ?= 20s

.PHONY: all build test unit fuzz vet fmt-check

all: build

## build: the multireg binary in bin/, static and stamped with the version.
build:
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags "$(LDFLAGS)" -o bin/multireg ./cmd/multireg

## test: everything CI runs: formatting, vet, unit tests with the race detector, a fuzz smoke run.
test: fmt-check vet unit fuzz

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
