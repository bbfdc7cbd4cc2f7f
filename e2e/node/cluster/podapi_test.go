package cluster

import (
	"bufio"
	"errors"
	"net"
	"syscall"
	"testing"
	"time"
)

// The pods' door to the API server forwards each connection to the backend while it is open;
// closed, it refuses new connections and ends the forwarded ones; opened again, it forwards.
func TestDoorForwardsWhileOpen(t *testing.T) {
	backend, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer backend.Close()
	go func() { // an echo server, one line per connection at a time
		for {
			c, err := backend.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				r := bufio.NewReader(c)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					if _, err := c.Write([]byte(line)); err != nil {
						return
					}
				}
			}()
		}
	}()
	port, err := FreePort()
	if err != nil {
		t.Fatal(err)
	}
	addr := net.JoinHostPort("127.0.0.1", itoa(port))
	var d door
	if err := d.open(addr, backend.Addr().String()); err != nil {
		t.Fatal(err)
	}
	echo := func(c net.Conn) error {
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write([]byte("ping\n")); err != nil {
			return err
		}
		line, err := bufio.NewReader(c).ReadString('\n')
		if err == nil && line != "ping\n" {
			err = errors.New("echoed " + line)
		}
		return err
	}
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := echo(c); err != nil {
		t.Fatalf("through the open door: %v", err)
	}
	if err := d.close(); err != nil {
		t.Fatal(err)
	}
	if err := echo(c); err == nil {
		t.Error("a connection forwarded before the door closed still works after")
	}
	if c2, err := net.Dial("tcp", addr); !errors.Is(err, syscall.ECONNREFUSED) {
		if c2 != nil {
			c2.Close()
		}
		t.Errorf("dial the closed door: %v; want connection refused", err)
	}
	if err := d.open(addr, backend.Addr().String()); err != nil {
		t.Fatal(err)
	}
	defer d.close()
	c3, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c3.Close()
	if err := echo(c3); err != nil {
		t.Fatalf("through the door opened again: %v", err)
	}
}
