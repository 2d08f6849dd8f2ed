# lumen — build, test, lint, generate, benchmark.
#
# Tools are pinned and installed into .tools/ by the targets that need them;
# `make test` needs nothing but the Go toolchain.

GO        ?= go
# go-nvml's cgo prologue calls NVML functions the header marks deprecated;
# gcc's warnings about them are noise.
export CGO_CFLAGS ?= -O2 -g -Wno-deprecated-declarations
TOOLS     := $(CURDIR)/.tools/bin
BIN       := bin/lumen

PROTOC_GEN_GO_VERSION      := v1.36.12
PROTOC_GEN_GO_GRPC_VERSION := v1.6.0
PROTOC_VERSION             := 3.21.12
STATICCHECK_VERSION        := v0.7.0

PROTO_FILES := $(wildcard proto/*.proto)

.PHONY: jepsen bench-recovery bench-migration fuzz bench-pacing bench-gateway all build test test-short lint proto proto-check demo bench bench-controller bench-go tools clean chromium npm

all: build

build:
	$(GO) build -o $(BIN) ./cmd/lumen

## test: vet, the unit tests with the race detector, then the multi-process
## e2e suite, a minute of jepsen and the simulator's tests without it. The
## processes under test are plain builds, and instrumenting the harness only
## slows the cluster it drives; the simulator runs one goroutine (a virtual
## clock over the worker core and the fsm, whose own packages run under -race
## in the first line), where the detector finds nothing and costs ten times
## the time (450 s against 45). The e2e suite drives the dashboard in Chromium
## and the gateway with the official openai npm client.
test: chromium npm
	$(GO) vet ./...
	$(GO) test -race -count=1 -timeout 20m $$($(GO) list ./... | grep -v -e /e2e -e /jepsen -e /sim$$)
	$(GO) test -count=1 -timeout 20m ./e2e/ ./jepsen/ ./sim/

## jepsen: the full fault-injection matrix (29 runs, about 75 minutes; partitions use
## network namespaces as root with iproute2, per-link TCP proxies otherwise).
## Histories and the summary land in jepsen-results/.
jepsen: build
	./$(BIN) jepsen -matrix -duration 2m -results jepsen-results

## chromium: Debian's Chromium, for the dashboard's browser test
## (e2e/ui_test.go), installed when no chromium is on PATH.
chromium:
	@if ! command -v chromium >/dev/null 2>&1; then \
		echo "installing chromium (Debian) for the dashboard's browser test"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	fi
	@command -v chromium >/dev/null 2>&1 || { echo "chromium is required by e2e/ui_test.go: apt-get install chromium (as root)"; exit 1; }

## npm: the official openai npm package for e2e/npm_test.go, installed in
## e2e/npm from its package-lock.json (npm ci) when node_modules is missing
## or older than the lock; Node.js and npm from Debian when absent.
npm:
	@if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then \
		echo "installing nodejs and npm (Debian) for the npm client's test"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null; \
	fi
	@command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 || { echo "node and npm are required by e2e/npm_test.go: apt-get install nodejs npm (as root)"; exit 1; }
	@if [ ! -f e2e/npm/node_modules/.package-lock.json ] || [ e2e/npm/package-lock.json -nt e2e/npm/node_modules/.package-lock.json ]; then \
		cd e2e/npm && npm ci --no-audit --no-fund; \
	fi

test-short:
	$(GO) test -count=1 ./policy/... ./fsm/...

## fuzz: fuzz the gateway's request decoder (new findings land in the build cache; copy them into testdata to keep them).
fuzz:
	$(GO) test -run '^$$' -fuzz FuzzDecodeRequest -fuzztime 60s ./gateway/

## demo: the README's first command.
demo: build
	./$(BIN) demo

lint: $(TOOLS)/staticcheck
	$(GO) vet ./...
	@out=$$(gofmt -l $$(git ls-files '*.go' | grep -v '\.pb\.go$$')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(TOOLS)/staticcheck ./...

## proto: regenerate the committed Go code from proto/*.proto.
proto: $(TOOLS)/protoc-gen-go $(TOOLS)/protoc-gen-go-grpc protoc
	PATH=$(TOOLS):$$PATH protoc -I proto \
		--go_out=proto/lumenpb --go_opt=paths=source_relative \
		--go-grpc_out=proto/lumenpb --go-grpc_opt=paths=source_relative \
		$(PROTO_FILES)

## proto-check: fail when the committed generated code is not what the .proto files generate.
proto-check: $(TOOLS)/protoc-gen-go $(TOOLS)/protoc-gen-go-grpc protoc
	@tmp=$$(mktemp -d); \
	PATH=$(TOOLS):$$PATH protoc -I proto \
		--go_out=$$tmp --go_opt=paths=source_relative \
		--go-grpc_out=$$tmp --go-grpc_opt=paths=source_relative \
		$(PROTO_FILES) && \
	if diff -ru proto/lumenpb $$tmp; then echo "proto: generated code is current"; rm -rf $$tmp; \
	else echo "proto: generated code is stale; run 'make proto' and commit"; rm -rf $$tmp; exit 1; fi

protoc:
	@if ! protoc --version 2>/dev/null | grep -q "$(PROTOC_VERSION)"; then \
		echo "installing protoc $(PROTOC_VERSION) (Debian protobuf-compiler)"; \
		apt-get update -qq && apt-get install -y -qq protobuf-compiler >/dev/null; \
	fi
	@protoc --version | grep -q "$(PROTOC_VERSION)" || { echo "protoc $(PROTOC_VERSION) required, found $$(protoc --version)"; exit 1; }

$(TOOLS)/protoc-gen-go:
	GOBIN=$(TOOLS) $(GO) install google.golang.org/protobuf/cmd/protoc-gen-go@$(PROTOC_GEN_GO_VERSION)

$(TOOLS)/protoc-gen-go-grpc:
	GOBIN=$(TOOLS) $(GO) install google.golang.org/grpc/cmd/protoc-gen-go-grpc@$(PROTOC_GEN_GO_GRPC_VERSION)

$(TOOLS)/staticcheck:
	GOBIN=$(TOOLS) $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)

## bench: every benchmark; figures go in docs/benchmarks.md.
bench: bench-go bench-controller bench-pacing bench-gateway bench-recovery bench-migration

bench-go:
	$(GO) test -run '^$$' -bench Holder10k -benchtime 20000x -count 5 ./policy/
	$(GO) test -run '^$$' -bench . -cpu 1 -benchtime 2s ./worker/engine/

bench-pacing: build
	mkdir -p bench-results
	./$(BIN) bench pacing -json bench-results/pacing.json

bench-gateway: build
	mkdir -p bench-results
	./$(BIN) bench gateway -json bench-results/gateway.json

bench-controller: build
	mkdir -p bench-results
	./$(BIN) bench controller -json bench-results/controller.json

bench-migration: build
	mkdir -p bench-results
	./$(BIN) bench migration -json bench-results/migration.json

bench-recovery: build
	mkdir -p bench-results
	./$(BIN) bench recovery -json bench-results/recovery.json

clean:
	rm -rf bin

## sim: the simulator's figures (docs/benchmarks.md, "Simulation"): the
## setups beside `bench recovery` (the headline ones at the seed's stress,
## then the -mild ones), every figure at 64 workers under the mild
## conditions, then the recovery figures at the stress (-stress: about three
## minutes a point on two cores); JSON in bench-results/, plots in docs/sim/.
.PHONY: sim
sim: build
	mkdir -p bench-results
	./$(BIN) sim -setups w4,w8,w8_f4 -seed 1 -json bench-results/sim-setups.json
	./$(BIN) sim -setups w4-mild,w8-mild,w8_f4-mild -seed 1 -json bench-results/sim-setups-mild.json
	for f in failures load proportional lambda budget; do \
		./$(BIN) sim -figure $$f -seed 1 -json bench-results/sim-$$f.json -svg docs/sim/$$f.svg || exit 1; \
	done
	./$(BIN) sim -figure failures -stress -xs 1,4,16 -seed 1 -json bench-results/sim-failures-stress.json -svg docs/sim/failures-stress.svg
	./$(BIN) sim -figure proportional -stress -seed 1 -json bench-results/sim-proportional-stress.json -svg docs/sim/proportional-stress.svg
	./$(BIN) sim -figure load -stress -xs 0.7,0.9,0.95 -seed 1 -json bench-results/sim-load-stress.json -svg docs/sim/load-stress.svg
