// Package healthz holds the liveness and readiness answers every lumen
// process serves (/healthz, /readyz). Each answer carries the answering
// process's id, so that a supervisor that started a process on a port can
// tell its own child from whatever else holds that port: a port picked
// free and then taken by another process before the child binds it, or a
// -http address already in use, would otherwise answer for a child that
// never started.
package healthz

import (
	"fmt"
	"net/http"
	"os"
	"strconv"
)

// PidHeader is the response header that names the answering process.
const PidHeader = "Lumen-Pid"

var pid = strconv.Itoa(os.Getpid())

// Stamp marks w's response as this process's.
func Stamp(w http.ResponseWriter) { w.Header().Set(PidHeader, pid) }

// OK answers a liveness probe: "ok", stamped.
func OK(w http.ResponseWriter, _ *http.Request) {
	Stamp(w)
	fmt.Fprintln(w, "ok")
}

// From reports whether resp was answered by process pid.
func From(resp *http.Response, pid int) bool {
	return resp.Header.Get(PidHeader) == strconv.Itoa(pid)
}
