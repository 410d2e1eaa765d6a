// Command seccomp prints containerd's RuntimeDefault seccomp profile for this GOARCH, for a
// container with the capabilities named on the command line (none: a container that drops
// ALL), as OCI runtime-spec JSON. generate.py runs it for every architecture the engine
// image has and merges the results.
package main

import (
	"encoding/json"
	"os"

	"github.com/containerd/containerd/v2/contrib/seccomp"
	specs "github.com/opencontainers/runtime-spec/specs-go"
)

func main() {
	caps := os.Args[1:]
	sp := &specs.Spec{Process: &specs.Process{Capabilities: &specs.LinuxCapabilities{Bounding: caps}}}
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	if err := enc.Encode(seccomp.DefaultProfile(sp)); err != nil {
		os.Exit(1)
	}
}
