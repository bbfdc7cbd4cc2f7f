package registrar

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"testing"
)

// TestTableIsTotal: for every state and every event, the table has a row exactly when the
// state's wait may report the event (waits), or the event ends the loop or brings it a new
// policy. Every pair a loop can meet is decided by a row, and no row waits for a pair that
// never comes; a Stopped loop meets nothing.
func TestTableIsTotal(t *testing.T) {
	for s := range numStates {
		for k := range numEvents {
			want := s != stStopped && k != evNone && (reports(s, k) || k == evReload)
			if got := table[s][k] != nil; got != want {
				t.Errorf("%s on %s: a row %v, want %v (waits says what %s's wait reports)", s, k, got, want, s)
			}
		}
	}
	for _, r := range rows {
		if len(r.to) == 0 {
			t.Errorf("the row from %s on %s goes nowhere", r.from, r.on)
		}
		for _, d := range r.to {
			if d.what == "" {
				t.Errorf("the row from %s on %s says nothing of going to %s", r.from, r.on, d.to)
			}
		}
	}
}

// TestWaitsReportWhatTheyDeclare: each state's wait can report, in its code, only events that
// the states waiting with it declare (waits), a new policy or the end of the loop. The events a
// wait can report are read from the package's source: every event its function, and every
// function of the package it calls (by name, transitively), names; for the states that await
// cur, run's own code too, which inlines the wait. With TestTableIsTotal, no pair without a row
// can reach step.
//
// The check is over every state that shares a wait: what one of them reports and another does
// not (a rollover settled, a drop repaired and a timeout armed only while Registered or
// AwaitingVerdict) is decided by the wait's own guards on the state, which cut checks as the
// loop runs.
func TestWaitsReportWhatTheyDeclare(t *testing.T) {
	funcs := packageFuncs(t)
	byWait := map[string][]state{}
	for s := range stStopped {
		name := funcName(waits[s].wait)
		if _, ok := funcs[name]; !ok {
			t.Fatalf("%s's wait %s is not in the package's source", s, name)
		}
		byWait[name] = append(byWait[name], s)
	}
	for name, states := range byWait {
		roots := []string{name}
		if slices.ContainsFunc(states, state.awaits) {
			roots = append(roots, "run") // run calls await's parts itself
		}
		for _, k := range eventsNamed(funcs, roots...) {
			if !slices.ContainsFunc(states, func(s state) bool { return reports(s, k) }) {
				t.Errorf("%s, the wait of %v, can report %s, which none of them declares (machine.go: waits)", name, states, k)
			}
		}
	}
}

// TestEndsComeFromTheContext: a wait reports the end of the loop, or a new policy, only as its
// context's end says (interrupted, stopped): no function of the package names an end event
// but stopped, nor Reload but interrupted and run (which steps on the policy it takes), so no
// wait can end the loop while its context lives.
func TestEndsComeFromTheContext(t *testing.T) {
	funcs := packageFuncs(t)
	allowed := map[eventKind][]string{evRemoved: {"stopped"}, evShutdown: {"stopped"}, evHandOver: {"stopped"}, evReload: {"interrupted", "run"}}
	for name := range funcs {
		for _, k := range eventsNamedBy(funcs, name) {
			if want, ok := allowed[k]; ok && !slices.Contains(want, name) {
				t.Errorf("%s names %s: only %v may", name, k, want)
			}
		}
	}
}

// funcName is the name of f, a function or method of the package.
func funcName(f any) string {
	full := runtime.FuncForPC(reflect.ValueOf(f).Pointer()).Name()
	return strings.TrimSuffix(full[strings.LastIndex(full, ".")+1:], "-fm")
}

// packageFuncs are the package's functions and methods, by name (methods of several types
// under one name: a call by that name may reach any of them).
func packageFuncs(t *testing.T) map[string][]*ast.FuncDecl {
	t.Helper()
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	funcs := map[string][]*ast.FuncDecl{}
	fset := token.NewFileSet()
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		file, err := parser.ParseFile(fset, f, src, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range file.Decls {
			if fd, ok := d.(*ast.FuncDecl); ok {
				funcs[fd.Name.Name] = append(funcs[fd.Name.Name], fd)
			}
		}
	}
	return funcs
}

// eventsNamedBy are the events (but None) named in the body of the functions name, not in what
// they call.
func eventsNamedBy(funcs map[string][]*ast.FuncDecl, name string) []eventKind {
	var kinds []eventKind
	for _, fd := range funcs[name] {
		ast.Inspect(fd.Body, func(node ast.Node) bool {
			if x, ok := node.(*ast.Ident); ok && strings.HasPrefix(x.Name, "ev") {
				if k := eventNamed(strings.TrimPrefix(x.Name, "ev")); k != numEvents && k != evNone && !slices.Contains(kinds, k) {
					kinds = append(kinds, k)
				}
			}
			return true
		})
	}
	return kinds
}

// eventsNamed are the events (but None) named in the functions names and in every function of
// the package they call, transitively.
func eventsNamed(funcs map[string][]*ast.FuncDecl, names ...string) []eventKind {
	seen := map[string]bool{}
	queue := slices.Clone(names)
	for _, n := range names {
		seen[n] = true
	}
	var kinds []eventKind
	for len(queue) > 0 {
		n := queue[0]
		queue = queue[1:]
		for _, fd := range funcs[n] {
			ast.Inspect(fd.Body, func(node ast.Node) bool {
				switch x := node.(type) {
				case *ast.Ident:
					if k := eventNamed(strings.TrimPrefix(x.Name, "ev")); strings.HasPrefix(x.Name, "ev") && k != numEvents && k != evNone && !slices.Contains(kinds, k) {
						kinds = append(kinds, k)
					}
				case *ast.CallExpr:
					var callee string
					switch fn := x.Fun.(type) {
					case *ast.Ident:
						callee = fn.Name
					case *ast.SelectorExpr:
						callee = fn.Sel.Name
					}
					if _, ok := funcs[callee]; ok && !seen[callee] {
						seen[callee] = true
						queue = append(queue, callee)
					}
				}
				return true
			})
		}
	}
	return kinds
}
