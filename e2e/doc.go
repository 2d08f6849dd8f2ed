// Package e2e holds end-to-end tests over the real lumen binary: separate
// OS processes on loopback, killed with SIGKILL.
package e2e
