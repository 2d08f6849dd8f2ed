package main

import "fmt"

// onOff is a flag that takes on or off, into *v; any other value is an
// error naming the allowed ones (the flag package names the flag).
type onOff struct{ v *bool }

func (f onOff) String() string {
	if f.v != nil && *f.v {
		return "on"
	}
	return "off"
}

func (f onOff) Set(s string) error {
	switch s {
	case "on":
		*f.v = true
	case "off":
		*f.v = false
	default:
		return fmt.Errorf("want on or off")
	}
	return nil
}
