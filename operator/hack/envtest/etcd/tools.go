//go:build tools

// etcd, the envtest control plane's store.
package tools

import _ "go.etcd.io/etcd/server/v3"
