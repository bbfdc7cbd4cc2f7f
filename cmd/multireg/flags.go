package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"regexp"
	"strconv"
	"strings"
	"text/tabwriter"
)

// command is one subcommand's flags and help. Its help goes to stdout, as kubectl's and
// promtool's do, and names the flags as the docs write them: --config, -v, -o. A parse error
// is returned, never printed: main prints it once. A single-valued flag given twice is
// refused instead of the last one silently winning.
type command struct {
	name     string // "run"
	synopsis string // what follows "multireg <name>" in the usage line
	about    string // what the command does, a paragraph or more
	footer   string // after the flags: signals, exit codes
	fs       *flag.FlagSet
	flags    []flagHelp
}

// flagHelp is one flag as its help shows it.
type flagHelp struct {
	names     []string // the first is the one the docs use
	arg, text string
	def       string // shown when not empty
}

func newCommand(name, synopsis, about string) *command {
	fs := flag.NewFlagSet("multireg "+name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	return &command{name: name, synopsis: synopsis, about: about, fs: fs}
}

// String defines a string flag under every name of names ("config,f,filename").
func (c *command) String(p *string, names, arg, def, text string) {
	*p = def
	c.add(&onceValue{Value: (*stringValue)(p)}, names, arg, def, text)
}

// Int defines an int flag.
func (c *command) Int(p *int, names, arg string, def int, text string) {
	*p = def
	d := ""
	if def != 0 {
		d = strconv.Itoa(def)
	}
	c.add(&onceValue{Value: (*intValue)(p)}, names, arg, d, text)
}

// Bool defines a bool flag.
func (c *command) Bool(p *bool, names, text string) {
	*p = false
	c.add(&onceBool{onceValue{Value: (*boolValue)(p)}}, names, "", "", text)
}

func (c *command) add(v flag.Value, names, arg, def, text string) {
	h := flagHelp{names: strings.Split(names, ","), arg: arg, text: text, def: def}
	for _, n := range h.names {
		c.fs.Var(v, n, text)
	}
	c.flags = append(c.flags, h)
}

// errHelp ends a command whose help was asked for and printed.
var errHelp = errors.New("help requested")

// parse parses args and refuses positional arguments. -h, --help and -help print the help on
// stdout and return errHelp.
func (c *command) parse(args []string, stdout io.Writer) error {
	if err := c.fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			c.help(stdout)
			return errHelp
		}
		return c.usageError("%s", flagError(err))
	}
	if c.fs.NArg() > 0 {
		return c.usageError("unexpected argument %q", c.fs.Arg(0))
	}
	return nil
}

// flagError rewords the flag package's errors with the flags spelled as the docs spell them.
func flagError(err error) string {
	msg := err.Error()
	if m := regexp.MustCompile(`^flag provided but not defined: -+(.*)$`).FindStringSubmatch(msg); m != nil {
		return "unknown flag " + dashes(m[1])
	}
	if m := regexp.MustCompile(`^flag needs an argument: -+(.*)$`).FindStringSubmatch(msg); m != nil {
		return dashes(m[1]) + " needs a value"
	}
	if m := regexp.MustCompile(`(?s)^invalid (?:boolean )?value (".*") for flag -+(\S+): (.*)$`).FindStringSubmatch(msg); m != nil {
		return dashes(m[2]) + " " + m[1] + ": " + m[3]
	}
	return msg
}

// usageError is a usage error of this command, with where to find its help.
func (c *command) usageError(format string, args ...any) error {
	return usagef("multireg %s: %s\nRun 'multireg %s --help' for usage.", c.name, fmt.Sprintf(format, args...), c.name)
}

// help writes the command's help: usage, description, flags, and the footer.
func (c *command) help(w io.Writer) {
	fmt.Fprintf(w, "%s\n\nUsage:\n  multireg %s %s\n", c.about, c.name, c.synopsis)
	if len(c.flags) > 0 {
		fmt.Fprintf(w, "\nFlags:\n")
		tw := tabwriter.NewWriter(w, 0, 0, 3, ' ', 0)
		for _, f := range c.flags {
			var names []string
			for _, n := range f.names {
				names = append(names, dashes(n))
			}
			spelled := strings.Join(names, ", ")
			if f.arg != "" {
				spelled += " " + f.arg
			}
			text := f.text
			if f.def != "" {
				text += fmt.Sprintf(" (default %q)", f.def)
			}
			fmt.Fprintf(tw, "  %s\t%s\n", spelled, text)
		}
		fmt.Fprintf(tw, "  -h, --help\tprint this help\n")
		tw.Flush()
	}
	if c.footer != "" {
		fmt.Fprintf(w, "\n%s\n", strings.TrimRight(c.footer, "\n"))
	}
}

// dashes spells a flag as the docs do: one dash for a one-letter flag, two otherwise.
func dashes(name string) string {
	if len(name) == 1 {
		return "-" + name
	}
	return "--" + name
}

// onceValue refuses a second value: a flag given twice is a mistake whichever value was
// meant, and the last one silently winning would hide it (validate --config bad --config good).
// Every name of a flag shares one onceValue, so --config FILE -f FILE is refused too.
type onceValue struct {
	flag.Value
	set bool
}

func (o *onceValue) Set(s string) error {
	if o.set {
		return fmt.Errorf("given more than once (it takes one value)")
	}
	o.set = true
	return o.Value.Set(s)
}

// onceBool is a onceValue of a bool flag, which takes no argument.
type onceBool struct{ onceValue }

func (*onceBool) IsBoolFlag() bool { return true }

type stringValue string

func (s *stringValue) Set(v string) error { *s = stringValue(v); return nil }
func (s *stringValue) String() string     { return string(*s) }

type intValue int

func (i *intValue) Set(v string) error {
	n, err := strconv.Atoi(v)
	if err != nil {
		return fmt.Errorf("%q: not a whole number", v)
	}
	*i = intValue(n)
	return nil
}
func (i *intValue) String() string { return strconv.Itoa(int(*i)) }

type boolValue bool

func (b *boolValue) Set(v string) error {
	x, err := strconv.ParseBool(v)
	if err != nil {
		return fmt.Errorf("%q: not true or false", v)
	}
	*b = boolValue(x)
	return nil
}
func (b *boolValue) String() string { return strconv.FormatBool(bool(*b)) }
