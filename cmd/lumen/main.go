// Command lumen is the single binary of a lumen cluster: controller replicas,
// operator commands, the demo and the benchmarks, as subcommands in the
// manner of consul and nomad.
package main

import (
	"fmt"
	"os"
	"sort"
	"strings"
)

type command struct {
	summary string
	run     func(args []string) error
}

var commands = map[string]command{}

func register(name, summary string, run func(args []string) error) {
	commands[name] = command{summary, run}
}

func usage() {
	fmt.Fprintf(os.Stderr, "Usage: lumen <command> [flags]\n\nCommands:\n")
	names := make([]string, 0, len(commands))
	for n := range commands {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(os.Stderr, "  %-22s %s\n", n, commands[n].summary)
	}
	fmt.Fprintf(os.Stderr, "\nRun 'lumen <command> -h' for a command's flags.\n")
}

func main() {
	if len(os.Args) < 2 || os.Args[1] == "-h" || os.Args[1] == "--help" || os.Args[1] == "help" {
		usage()
		os.Exit(2)
	}
	name, args := resolve(os.Args[1], os.Args[2:])
	cmd, ok := commands[name]
	if !ok {
		fmt.Fprintf(os.Stderr, "lumen: unknown command %q\n\n", strings.Join(os.Args[1:min(3, len(os.Args))], " "))
		usage()
		os.Exit(2)
	}
	if err := cmd.run(args); err != nil {
		fmt.Fprintf(os.Stderr, "lumen %s: %v\n", name, err)
		os.Exit(1)
	}
}

// resolve finds the command named by the first words of the command line.
// Two-word commands: "operator raft", "bench controller", ... A two-word
// command wins over a one-word one it starts with ("worker drain" over
// "worker").
func resolve(first string, rest []string) (string, []string) {
	if len(rest) > 0 {
		if _, ok := commands[first+" "+rest[0]]; ok {
			return first + " " + rest[0], rest[1:]
		}
	}
	return first, rest
}

func sortStrings(s []string) []string { sort.Strings(s); return s }
